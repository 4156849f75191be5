"""The NIXL learner's sender (raysync/transports/nixl/learner.py) with a real NIXL agent,
without Ray: which sends wait for the broadcast that last filled a buffer, which buffer a
version goes into, and when a model's buffers are let go of.

Each model has two registered buffers; a third version of a model waits until the
broadcast that filled its buffer first has ended (its receivers read it). That wait is
the model's own: another model's versions go out meanwhile. A model none of whose
versions the hub took lets go of its buffers.
"""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, VersionDone
from raysync.transports.nixl.learner import NixlSender

#: Bound on a wait that must end at once (it ends in milliseconds): a failure, not a hang.
_PROMPT_S = 30.0


class _HeldBroadcast(VersionDone):
    """A broadcast whose receivers have not finished until :meth:`end`; ``waited`` is set
    when a sender starts waiting for it."""

    def __init__(self) -> None:
        self._ended = threading.Event()
        self.waited = threading.Event()

    def wait(self, timeout_s: float) -> None:
        if timeout_s > 0:
            self.waited.set()
        if not self._ended.wait(timeout_s):
            raise TimeoutError("the broadcast is still running")

    def end(self) -> None:
        self._ended.set()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, generator=generator), "b": torch.randn(8, generator=generator)}


@pytest.fixture
def sender():
    sender = NixlSender()
    yield sender
    sender.close()


@pytest.fixture
def held(sender):
    """A broadcast that ends when the test is done with it, at the latest at teardown
    (before the sender closes: a send still waiting for it returns first)."""
    held = _HeldBroadcast()
    yield held
    held.end()


def _in_thread(call) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["payload"] = call()
        except BaseException as err:  # handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _fill_both_buffers(sender: NixlSender, model: str, held: _HeldBroadcast) -> WeightSpec:
    weights = _weights(1)
    spec = WeightSpec.of(weights)
    for _ in range(2):
        sender.submitted(sender.send(weights, spec, model), held)
    return spec


def test_a_model_waiting_for_its_buffer_does_not_hold_up_another_models_send(sender, held):
    spec = _fill_both_buffers(sender, "slow", held)
    waiting, waited_outcome = _in_thread(lambda: sender.send(_weights(2), spec, "slow"))
    assert held.waited.wait(_PROMPT_S), "the third version of 'slow' did not wait"

    other, other_outcome = _in_thread(lambda: sender.send(_weights(3), spec, "fast"))
    other.join(_PROMPT_S)
    assert not other.is_alive(), "model 'fast' waited for model 'slow''s broadcast"
    sender.submitted(other_outcome["payload"], None)
    assert waiting.is_alive()  # 'slow' still waits for its receivers

    held.end()
    waiting.join(_PROMPT_S)
    assert not waiting.is_alive() and "payload" in waited_outcome
    sender.submitted(waited_outcome["payload"], None)


def test_a_send_that_waited_while_the_sender_closed_fails_naming_its_model(sender, held):
    spec = _fill_both_buffers(sender, "slow", held)
    waiting, outcome = _in_thread(lambda: sender.send(_weights(2), spec, "slow"))
    assert held.waited.wait(_PROMPT_S)
    closing, _ = _in_thread(sender.close)
    closing.join(_PROMPT_S)
    assert not closing.is_alive(), "close waited for a send's broadcast"
    held.end()
    waiting.join(_PROMPT_S)
    assert not waiting.is_alive()
    assert isinstance(outcome.get("error"), TransportError)
    assert "'slow'" in str(outcome["error"]) and "closed" in str(outcome["error"])


def test_a_send_after_the_sender_closed_fails_and_registers_nothing():
    """Another thread's broadcast took the sender before the learner's handle closed
    it: its send registered a fresh pair of buffers that nothing deregistered."""
    sender = NixlSender()
    sender.close()
    weights = _weights(1)
    with pytest.raises(TransportError, match="closed before model 'late'"):
        sender.send(weights, WeightSpec.of(weights), "late")
    assert sender._pairs == {}


def test_a_version_submitted_after_the_sender_closed_fails_saying_so():
    """Another thread released the handle (or the hub went) between this version's send
    and its submit: the submit raised a bare KeyError of a buffer's address."""
    sender = NixlSender()
    weights = _weights(0)
    payload = sender.send(weights, WeightSpec.of(weights), "m")
    sender.close()
    with pytest.raises(TransportError, match="sender closed before version stamp"):
        sender.submitted(payload, None)


class _RefusingAgent:
    """The sender's own agent, refusing to register memory (as when pinned memory ran
    out, or UCX cannot register the device); every other call goes to the agent."""

    def __init__(self, agent) -> None:
        self._agent = agent

    def register_memory(self, tensors):
        raise RuntimeError("NIXL_ERR_BACKEND (injected)")

    def __getattr__(self, name: str):
        return getattr(self._agent, name)


def test_buffers_nixl_cannot_register_fail_the_send_naming_the_model_and_size():
    sender = NixlSender()
    agent = sender._agent
    sender._agent = _RefusingAgent(agent)
    weights = _weights(1)
    try:
        with pytest.raises(TransportError) as raised:
            sender.send(weights, WeightSpec.of(weights), "policy")
        message = str(raised.value)
        assert "two send buffers of model 'policy'" in message
        assert "bytes on cpu" in message and "NIXL_ERR_BACKEND (injected)" in message
        assert sender._pairs == {}  # nothing kept: the next send registers again
    finally:
        sender._agent = agent
        sender.close()


class _InterruptedOnce(VersionDone):
    """A running broadcast: the first wait for it is interrupted (Ctrl-C), each later
    one returns (it ended); ``waits`` counts them."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise TimeoutError("the broadcast is still running")
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt


def test_a_send_interrupted_waiting_for_a_broadcast_leaves_the_next_one_waiting_for_it(sender):
    """The buffer's broadcast was forgotten as the wait began: after an interrupted
    send, the next version into that buffer was written under that broadcast's readers
    (the stamps made them fail it, rather than apply torn data)."""
    weights = _weights(1)
    spec = WeightSpec.of(weights)
    first = _InterruptedOnce()
    sender.submitted(sender.send(weights, spec, "m"), first)  # buffer A
    sender.submitted(sender.send(weights, spec, "m"), None)  # buffer B
    with pytest.raises(KeyboardInterrupt):
        sender.send(weights, spec, "m")  # buffer A: waits for the first broadcast
    sender.submitted(sender.send(weights, spec, "m"), None)  # buffer B
    sender.submitted(sender.send(weights, spec, "m"), None)  # buffer A again
    assert first.waits == 2, "the next version into its buffer did not wait for it"


def test_a_closed_sender_stops_progressing_its_agent():
    """Its progress thread ended only once the sender was collected (a full collection
    away: a cycle keeps it), polling the agent meanwhile, one more per closed sender."""
    sender = NixlSender()
    name = f"raysync-nixl-progress-{sender._agent.name}"
    (progress,) = [thread for thread in threading.enumerate() if thread.name == name]
    sender.close()
    progress.join(_PROMPT_S)
    assert not progress.is_alive(), "the closed sender's agent is still progressed"


class _Ended(VersionDone):
    """A broadcast that has ended: published (its receivers acked or failed), or, with
    ``refused=True``, refused by the hub before it was published (a stale explicit
    version, a named worker that died): that version never became the hub's latest."""

    def __init__(self, refused: bool = False) -> None:
        self._refused = refused

    def wait(self, timeout_s: float) -> None:
        return None

    def refused(self) -> bool:
        return self._refused


def _published(sender: NixlSender, weights: dict[str, torch.Tensor], model: str = "m"):
    """Send ``weights`` as a version the hub published (its broadcast ended)."""
    payload = sender.send(weights, WeightSpec.of(weights), model)
    sender.submitted(payload, _Ended())
    return payload


def _holds(sender: NixlSender, payload, weights: dict[str, torch.Tensor]) -> bool:
    """Whether ``payload``'s buffer still holds that version, as a late joiner handed it
    reads it: every bucket stamped with its stamp, and the data ``weights`` packed."""
    buffer = sender._by_address[payload.region.address]
    layout = buffer.frame.layout
    packed = torch.zeros_like(buffer.tensor)
    layout.pack(layout.byte_views(weights), packed)
    data = slice(layout.header_bytes, None)
    stamped = bool((buffer.frame.stamps(buffer.tensor) == payload.stamp).all())
    return stamped and torch.equal(buffer.tensor[data], packed[data])


def test_two_abandoned_versions_in_a_row_leave_the_latest_readable(sender):
    """The hub's latest stays readable for late joiners and pulls: the second version
    that failed before it left was written into the latest's buffer (each send took the
    buffer not written last time), and receivers restarting failed it."""
    weights = _weights(1)
    latest = _published(sender, weights)
    spec = WeightSpec.of(weights)
    for seed in (2, 3):
        sender.abandoned(sender.send(_weights(seed), spec, "m"), "failed before it left")
    assert _holds(sender, latest, weights), "an abandoned version overwrote the latest"


def test_two_refused_versions_in_a_row_leave_the_latest_readable(sender):
    """As above, for versions the hub refused (``workers=`` naming a worker that just
    died, a stale explicit ``version=``): they were written and ended, never published."""
    weights = _weights(1)
    latest = _published(sender, weights)
    spec = WeightSpec.of(weights)
    for seed in (2, 3):
        refused = sender.send(_weights(seed), spec, "m")
        sender.submitted(refused, _Ended(refused=True))
        assert refused.region != latest.region, "a refused version went into the latest's"
    assert _holds(sender, latest, weights), "a refused version overwrote the latest"


def test_after_refused_and_abandoned_versions_the_published_ones_alternate(sender):
    """The invariant: a send never writes into the buffer of the latest published
    version. A version that never became the latest leaves its buffer to the next one;
    once one is published, the next goes into the other buffer, as always."""
    first = _weights(1)
    spec = WeightSpec.of(first)
    v1 = _published(sender, first)
    refused = sender.send(_weights(2), spec, "m")
    sender.submitted(refused, _Ended(refused=True))
    sender.abandoned(sender.send(_weights(3), spec, "m"), "failed before it left")
    second = _weights(4)
    v2 = _published(sender, second)
    assert v2.region == refused.region != v1.region
    third = _weights(5)
    v3 = _published(sender, third)
    assert v3.region == v1.region, "the version after a published one did not alternate"
    assert _holds(sender, v2, second) and _holds(sender, v3, third)


def test_a_version_whose_broadcast_runs_still_is_taken_for_the_latest(sender, held):
    """Whether the hub publishes a version is known once its broadcast ends: until then
    the next version goes into the other buffer (waiting for its broadcast there)."""
    weights = _weights(1)
    spec = WeightSpec.of(weights)
    v1 = _published(sender, weights)
    running = sender.send(_weights(2), spec, "m")
    sender.submitted(running, held)
    v3 = sender.send(_weights(3), spec, "m")
    assert v3.region == v1.region != running.region
    sender.submitted(v3, None)


class _RefusalOnItsWay(VersionDone):
    """A broadcast the hub refused, whose refusal reaches the learner only once
    :meth:`arrive` says so: until then it runs, as far as the learner can tell."""

    def __init__(self) -> None:
        self._arrived = False

    def wait(self, timeout_s: float) -> None:
        if not self._arrived:
            raise TimeoutError("the hub's answer is not here yet")

    def arrive(self) -> None:
        self._arrived = True

    def refused(self) -> bool:
        return self._arrived


class _Deregistrations:
    """The sender's own agent, noting the registrations it is asked to deregister; every
    call goes to the agent."""

    def __init__(self, agent) -> None:
        self._agent = agent
        self.deregistered: list = []

    def deregister_memory(self, registered) -> None:
        self.deregistered.append(registered)
        self._agent.deregister_memory(registered)

    def __getattr__(self, name: str):
        return getattr(self._agent, name)


_CPU = torch.device("cpu")


def test_a_model_whose_every_version_the_hub_refused_lets_go_of_its_buffers(sender):
    """A misspelt model name (or a spec the hub refuses): its pair of buffers, twice the
    model's size, stayed registered until the sender closed, however often the learner
    tried again. Let go of once the refusal is known (at the latest at the next send);
    the model's next version registers a pair anew."""
    agent = sender._agent = _Deregistrations(sender._agent)
    weights = _weights(1)
    spec = WeightSpec.of(weights)
    refused = sender.send(weights, spec, "polcy")
    memory = weakref.ref(sender._by_address[refused.region.address].tensor)
    registered = sender._pairs[("polcy", spec, _CPU)].registered
    sender.submitted(refused, _Ended(refused=True))
    _published(sender, _weights(2), "policy")
    assert agent.deregistered == [registered], "the refused model's buffers stay registered"
    assert list(sender._pairs) == [("policy", spec, _CPU)]
    assert memory() is None, "the refused model's buffers are still held"
    again = _published(sender, weights, "polcy")
    assert again.registration > refused.registration
    assert _holds(sender, again, weights)


def test_a_refused_model_sent_again_writes_its_buffers_again(sender):
    """The learner tries the refused model again: its version goes into the pair it has
    (let go of and registered anew at each try, it made the receivers load the
    learner's metadata again each time, for the same memory)."""
    weights = _weights(1)
    spec = WeightSpec.of(weights)
    first = sender.send(weights, spec, "polcy")
    sender.submitted(first, _Ended(refused=True))
    again = sender.send(_weights(2), spec, "polcy")
    assert (again.registration, again.region) == (first.registration, first.region)
    sender.submitted(again, _Ended(refused=True))


def test_a_model_whose_first_version_was_abandoned_lets_go_of_its_buffers_at_once(sender):
    agent = sender._agent = _Deregistrations(sender._agent)
    weights = _weights(1)
    spec = WeightSpec.of(weights)
    payload = sender.send(weights, spec, "m")
    registered = sender._pairs[("m", spec, _CPU)].registered
    sender.abandoned(payload, "failed before it left")
    assert agent.deregistered == [registered] and sender._pairs == {}


def test_a_model_keeps_its_buffers_until_the_refusal_of_its_version_is_known(sender):
    """A version on its way (sent, not yet submitted) or whose broadcast runs may become
    the hub's latest: its buffers are kept until the hub's refusal is in."""
    weights = _weights(1)
    spec = WeightSpec.of(weights)
    key = ("polcy", spec, _CPU)
    on_its_way = sender.send(weights, spec, "polcy")
    _published(sender, _weights(2), "policy")
    assert key in sender._pairs, "a version on its way lost its buffers"
    refusal = _RefusalOnItsWay()
    sender.submitted(on_its_way, refusal)
    _published(sender, _weights(3), "policy")
    assert key in sender._pairs, "a version the hub may publish lost its buffers"
    assert _holds(sender, on_its_way, weights)
    refusal.arrive()
    _published(sender, _weights(4), "policy")
    assert key not in sender._pairs, "the refused model's buffers stay registered"


def test_a_model_the_hub_took_a_version_of_keeps_its_buffers_past_refusals(sender):
    """Late joiners read the hub's latest from the learner's buffer: a pair holding it is
    kept, however many refused versions follow."""
    weights = _weights(1)
    spec = WeightSpec.of(weights)
    latest = _published(sender, weights)
    for seed in (2, 3):
        sender.submitted(sender.send(_weights(seed), spec, "m"), _Ended(refused=True))
    _published(sender, _weights(4), "other")
    assert ("m", spec, _CPU) in sender._pairs
    assert _holds(sender, latest, weights), "a refused version overwrote the latest"
