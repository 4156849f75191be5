"""raysync/model_path.py without Ray: a receiver's model path resolved on the actor.

``parse`` splits ``"nets.critic"``, ``"env.transform[0]"``, ``"nets['q1']"`` into steps
and refuses malformed paths naming the position; ``resolve`` walks attributes, list
and module indices and string keys, and its errors name the path, the part walked so
far, the type that lacked the step and the step itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raysync.errors import ModelPathError
from raysync.model_path import Step, parse, resolve


def _actor() -> SimpleNamespace:
    """A receiver actor's attributes: modules, containers of modules, plain objects."""
    critic = torch.nn.Linear(3, 1)
    return SimpleNamespace(
        policy=torch.nn.Linear(3, 2),
        nets=SimpleNamespace(critic=critic, q=torch.nn.ModuleDict({"q1": torch.nn.Linear(2, 2)})),
        env=SimpleNamespace(transform=[torch.nn.Identity(), torch.nn.Linear(4, 4)]),
        seq=torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU(), torch.nn.Linear(1, 5)),
        by_name={"weird.key": torch.nn.Linear(1, 2), "with]bracket": "b", 'it"s': "q"},
    )


@pytest.mark.parametrize(
    "path, steps",
    [
        ("policy", [Step("policy", False)]),
        ("nets.critic", [Step("nets", False), Step("critic", False)]),
        ("env.transform[0]", [Step("env", False), Step("transform", False), Step(0, True)]),
        ("seq[-1].weight", [Step("seq", False), Step(-1, True), Step("weight", False)]),
        ("nets.q['q1']", [Step("nets", False), Step("q", False), Step("q1", True)]),
        ('by_name["weird.key"]', [Step("by_name", False), Step("weird.key", True)]),
        ("by_name['with]bracket']", [Step("by_name", False), Step("with]bracket", True)]),
        ("""by_name['it"s']""", [Step("by_name", False), Step('it"s', True)]),
        (
            "_private.x_2[10][3]",
            [Step("_private", False), Step("x_2", False), Step(10, True), Step(3, True)],
        ),
    ],
)
def test_parse_splits_a_path_into_steps(path, steps):
    assert parse(path) == tuple(steps)


def test_steps_print_as_python_accessors():
    assert [str(s) for s in parse("env.transform[0]['k']")] == [
        ".env",
        ".transform",
        "[0]",
        "['k']",
    ]


@pytest.mark.parametrize(
    "path, message",
    [
        ("", "model path '' must start with an attribute name"),
        ("0policy", "model path '0policy' must start with an attribute name"),
        ("[0]", "model path '[0]' must start with an attribute name"),
        (".policy", "model path '.policy' must start with an attribute name"),
        ("nets..critic", "cannot parse model path 'nets..critic' at position 4"),
        ("nets.critic.", "cannot parse model path 'nets.critic.' at position 11"),
        ("env.transform[x]", "cannot parse model path 'env.transform[x]' at position 13"),
        ("env.transform[0", "cannot parse model path 'env.transform[0' at position 13"),
        ("nets['q1\"]", "cannot parse model path 'nets[\\'q1\"]' at position 4"),
        ("policy ", "cannot parse model path 'policy ' at position 6"),
        ("nets.1critic", "cannot parse model path 'nets.1critic' at position 4"),
    ],
)
def test_a_malformed_path_is_refused_naming_where(path, message):
    with pytest.raises(ModelPathError) as excinfo:
        parse(path)
    assert str(excinfo.value) == message
    with pytest.raises(ModelPathError):
        resolve(_actor(), path)


@pytest.mark.parametrize(
    "path, pick",
    [
        ("policy", lambda a: a.policy),
        ("nets.critic", lambda a: a.nets.critic),
        ("nets.critic.weight", lambda a: a.nets.critic.weight),
        ("env.transform[0]", lambda a: a.env.transform[0]),
        ("env.transform[1]", lambda a: a.env.transform[1]),
        ("env.transform[-1]", lambda a: a.env.transform[1]),
        ("seq[2]", lambda a: a.seq[2]),
        ("seq[-1].bias", lambda a: a.seq[2].bias),
        ("nets.q['q1']", lambda a: a.nets.q["q1"]),
        ('nets.q["q1"].weight', lambda a: a.nets.q["q1"].weight),
        ("by_name['weird.key']", lambda a: a.by_name["weird.key"]),
        ("by_name['with]bracket']", lambda a: a.by_name["with]bracket"]),
    ],
)
def test_resolve_returns_the_very_object_at_the_path(path, pick):
    actor = _actor()
    assert resolve(actor, path) is pick(actor)


@pytest.mark.parametrize(
    "path, message",
    [
        (
            "nets.actor",
            "model path 'nets.actor': self.nets (SimpleNamespace) has no '.actor' "
            "(AttributeError: 'types.SimpleNamespace' object has no attribute 'actor')",
        ),
        (
            "polcy",
            "model path 'polcy': self (SimpleNamespace) has no '.polcy' "
            "(AttributeError: 'types.SimpleNamespace' object has no attribute 'polcy')",
        ),
        (
            "env.transform[2]",
            "model path 'env.transform[2]': self.env.transform (list) has no '[2]' "
            "(IndexError: list index out of range)",
        ),
        (
            "nets.q['q2']",
            "model path \"nets.q['q2']\": self.nets.q (ModuleDict) has no \"['q2']\" "
            "(KeyError: 'q2')",
        ),
        (
            "policy[0]",
            "model path 'policy[0]': self.policy (Linear) has no '[0]' "
            "(TypeError: 'Linear' object is not subscriptable)",
        ),
        (
            "seq[5]",
            "model path 'seq[5]': self.seq (Sequential) has no '[5]' "
            "(IndexError: index 5 is out of range)",
        ),
    ],
)
def test_a_path_that_does_not_resolve_names_the_path_the_prefix_and_the_step(path, message):
    with pytest.raises(ModelPathError) as excinfo:
        resolve(_actor(), path)
    assert str(excinfo.value) == message
    assert excinfo.value.__cause__ is not None


def test_model_path_error_is_an_attribute_error():
    with pytest.raises(AttributeError):
        resolve(_actor(), "missing")
