"""keep_newest (raysync/bounded.py): the dicts that remember the last few of something
keep the newest entries, in insertion order (move_to_end counts as inserting)."""

from __future__ import annotations

from collections import OrderedDict

from raysync.bounded import keep_newest


def test_the_oldest_entries_beyond_the_count_go():
    entries = {key: None for key in "abcde"}
    keep_newest(entries, 3)
    assert list(entries) == ["c", "d", "e"]
    keep_newest(entries, 5)  # fewer than the count: nothing goes
    assert list(entries) == ["c", "d", "e"]


def test_an_entry_moved_to_the_end_is_among_the_newest():
    entries = OrderedDict.fromkeys("abc")
    entries.move_to_end("a")
    keep_newest(entries, 2)
    assert list(entries) == ["c", "a"]


def test_the_entries_kept_stay_and_count():
    entries = {key: None for key in "abcde"}
    keep_newest(entries, 3, kept={"a"})
    assert list(entries) == ["a", "d", "e"]
