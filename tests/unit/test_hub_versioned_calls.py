"""The hub's book of each learner's last versioned call, without Ray."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

from raysync.actors.hub import WeightHubActor


def test_an_unnumbered_call_is_versioned_without_a_word_in_the_book():
    """A request built by hand (``sequence`` 0) was versioned and published, then its
    call raised KeyError noting it: its caller was told a published version failed."""
    hub = SimpleNamespace(_versioned_calls=OrderedDict())
    numbered = SimpleNamespace(submitter="learner", sequence=3)
    WeightHubActor._note_versioned(hub, SimpleNamespace(submitter="by-hand", sequence=0), "m")
    WeightHubActor._note_versioned(hub, numbered, "m")
    assert hub._versioned_calls == {("learner", "m"): 3}
