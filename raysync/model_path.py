"""Resolve a receiver's model path such as ``"policy"``, ``"nets.critic"`` or
``"env.transform[0]"`` against the receiver actor (called in the receiver process)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, cast

from raysync.errors import ModelPathError

_STEP = re.compile(r"\.([A-Za-z_]\w*)|\[(-?\d+)\]|\[(['\"])(.*?)\3\]")
_FIRST = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class Step:
    """One hop of a model path: ``getattr`` (``item=False``) or ``[key]`` (``item=True``)."""

    key: str | int
    item: bool

    def __str__(self) -> str:
        return f"[{self.key!r}]" if self.item else f".{self.key}"


def parse(path: str) -> tuple[Step, ...]:
    """Split ``path`` into steps; raises :class:`ModelPathError` if it is malformed."""
    first = _FIRST.match(path)
    if first is None:
        raise ModelPathError(f"model path {path!r} must start with an attribute name")
    steps = [Step(first.group(0), item=False)]
    pos = first.end()
    while pos < len(path):
        match = _STEP.match(path, pos)
        if match is None:
            raise ModelPathError(f"cannot parse model path {path!r} at position {pos}")
        attr, index, _, key = match.groups()
        if attr is not None:
            steps.append(Step(attr, item=False))
        elif index is not None:
            steps.append(Step(int(index), item=True))
        else:
            steps.append(Step(key, item=True))
        pos = match.end()
    return tuple(steps)


def resolve(root: Any, path: str) -> Any:
    """The object at ``path`` on ``root``; raises :class:`ModelPathError` naming the step."""
    current = root
    walked = "self"
    for step in parse(path):
        try:
            # parse() makes an attribute step's key a str (an identifier).
            current = current[step.key] if step.item else getattr(current, cast(str, step.key))
        except (AttributeError, IndexError, KeyError, TypeError) as err:
            raise ModelPathError(
                f"model path {path!r}: {walked} ({type(current).__name__}) has no {str(step)!r} "
                f"({type(err).__name__}: {err})"
            ) from err
        walked += str(step)
    return current
