"""Helpers every Ray test module shares: starting hubs and receivers, bitwise checks,
the transport parameters. Test modules import from here (and ``tests.receivers``),
never from each other or from ``conftest``. ``assert_bitwise`` and ``wait_dead`` are
the conformance kit's (``raysync.testing``)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
import torch

from raysync import WeightHub
from raysync.testing import assert_bitwise
from raysync.testing import wait_dead as wait_dead  # re-exported for the tests
from tests.receivers import make_policy, state_of
from tests.signals import Gate as Gate  # re-exported for the tests

_ROOT = Path(__file__).parents[1]


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys, dtypes and values (``torch.equal``: NaN never equals NaN), wherever
    each lives (a receiver on a machine with CUDA stages in VRAM)."""
    assert actual.keys() == expected.keys()
    for key in expected:
        assert actual[key].dtype == expected[key].dtype, key
        assert torch.equal(actual[key].cpu(), expected[key].cpu()), f"{key} differs"


def hold_the_actor(actor, gate, entered=None) -> None:
    """Runs in an async actor through ``__ray_call__``: until ``gate`` opens, none of
    the actor's other calls runs (seen: a hub's ``status`` is not answered), as in a
    hung actor. ``entered`` (a Gate too) is opened once it holds the actor."""
    if entered is not None:
        ray.get(entered.open.remote())
    ray.get(gate.wait.remote())


def run_in_threads(*calls: tuple[str, Callable[..., None], tuple]) -> None:
    """Run each ``(name, target, args)`` in a thread of that name, all at once; return
    once every one ended (a test's threads that meet through events)."""
    threads = [threading.Thread(target=t, name=n, args=a) for n, t, a in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition"):
    """Poll ``condition()`` until it returns something true, and return that; fail
    naming ``what`` after ``timeout_s``. For state another process changes in its own
    time (a hold dropped in the background), never to wait for a call's effect."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:g} s")
        time.sleep(0.05)


def wait_for_file(path: Path, timeout_s: float = 60.0) -> None:
    """The handshake with an actor's stall point (see ``tests.receivers._Stalls``): wait
    until it touched ``path``."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.01)


def actor_pid(handle) -> int:
    """The process id of actor ``handle`` (asked through ``__ray_call__``: it never waits
    behind the actor's own methods' gates)."""
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))


def wait_process_exit(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until process ``pid`` (on this node) has exited, its memory released.
    ``wait_dead`` is not enough where that matters: Ray reports an actor dead when it
    takes the kill, and its process may run on for a while (a NIXL READ of its
    registered memory still succeeds then). Waits on a pidfd, which turns readable once
    the process has exited."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone (and reaped) already
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        assert poller.poll(timeout_s * 1000), f"process {pid} still runs {timeout_s} s on"
    finally:
        os.close(pidfd)


def cut_off_heartbeats(receiver) -> None:
    """Runs inside a receiver actor (``__ray_call__``): from now on its hub watch finds
    the hub unreachable (as across a network partition), so the hub stops hearing it."""

    def unreachable(timeout_s: float) -> bool:
        raise ray.exceptions.GetTimeoutError("cut off from the hub by the test")

    receiver._raysync_receiver.core.hub_knows_me = unreachable


def keep_two_reports(hub_actor) -> None:
    """Runs in the hub actor (``__ray_call__``): it keeps the reports of its last two
    ended broadcasts per model for ``wait_for``, not 256."""
    sys.modules[type(hub_actor).__module__]._REPORTS_KEPT = 2


def fail_snapshot_writes(hub_actor, failing: bool) -> None:
    """Runs in the hub actor (``__ray_call__``): while ``failing``, its writes to Ray's
    GCS (the restart snapshot) raise, as when the GCS cannot be reached."""
    snapshot = hub_actor._snapshot
    if not failing:
        del snapshot._put
        return

    def unreachable(key: str, value: bytes) -> None:
        raise ConnectionError(f"the GCS is unreachable (the test), writing {key!r}")

    snapshot._put = unreachable


def ask_refused_channels_again(learner) -> None:
    """Runs in a learner actor (``__ray_call__``): its channels ask at once again for
    a graph to receivers they could not reach (``REFUSED_FOR_S``, 30 s, set to 0)."""
    import raysync.learner_channel

    raysync.learner_channel.REFUSED_FOR_S = 0.0


def release_hub(learner) -> None:
    """Runs in a learner actor holding its hub handle as ``hub`` (``__ray_call__``, e.g.
    ``raysync.testing.PartLearner``): ``HubHandle.release``."""
    learner.hub.release()


def start(actors: list, cls, *args, **kwargs):
    """``cls.remote(...)``, killed after the test (``actors`` is the conftest fixture)."""
    handle = cls.remote(*args, **kwargs)
    actors.append(handle)
    return handle


def hold_until_opened(actors: list, holder, gate) -> ray.ObjectRef:
    """Call ``holder.hold(gate)`` and return once it runs (its ref): the holder's only
    method slot is taken, so a delivery from any other process (the hub, a learner)
    waits behind it. Ray orders only one caller's calls: a ``hold`` not yet running may
    still be overtaken by a call made after it from elsewhere."""
    entered = start(actors, Gate)
    held = holder.hold.remote(gate, entered)
    ray.get(entered.wait.remote())
    return held


def start_hub(actors: list, transport: str, actor_options: dict | None = None, **launch):
    """A new hub on ``transport``, killed after the test."""
    hub = WeightHub.options(**(actor_options or {})).remote(transport=transport, **launch)
    actors.append(hub)
    return hub


def ready(receivers) -> None:
    """Wait until each receiver's ``__init__`` (and so its registration) has finished."""
    ray.get([r.__ray_ready__.remote() for r in receivers])


def free_and_reach_all(hub, gate, blocked, holders, workers: tuple[str, ...]) -> None:
    """Open ``gate`` and wait for the method it ``blocked`` in a busy receiver; then a
    fresh 8 MB ``{"w": ...}`` version reaches exactly ``workers``, every one of
    ``holders`` (``tests.receivers.Holder``) holding it bit for bit."""
    ray.get(gate.open.remote())
    ray.get(blocked)
    weights = {"w": torch.randn(2048, 1024)}
    report = ray.get(hub.broadcast.remote(weights), timeout=60)
    assert report.acked == workers
    for holder in holders:
        assert_bitwise(ray.get(holder.state.remote()), weights)


def assert_policy_reaches(hub, collectors, workers: tuple[str, ...]) -> None:
    """Broadcast a fresh policy: exactly ``workers`` ack it and hold it bit for bit."""
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner), timeout=60)
    assert report.acked == workers and report.failed == {}
    for c in collectors:
        assert_bitwise(ray.get(c.state.remote()), state_of(learner))


def transport_params(*, heavy: bool = False, keep: tuple[str, ...] = ()) -> list:
    """One pytest param per registered transport but rdt, skipped (with the reason)
    where it cannot run. ``heavy=True`` marks every transport but the default and
    ``keep`` ``slow``: long fault and soak runs go through those in CI and through all
    of them with ``make test-all`` (``-m "not gpu"``)."""
    from raysync.transports import (
        DEFAULT_TRANSPORT,
        get_transport,
        known_transports,
        registered_transports,
    )

    third_party = dict(registered_transports())  # tests/test_conformance.py covers those
    params = []
    for name in known_transports():
        if name in third_party:
            continue
        if name == "rdt":
            # rdt needs receivers declared with enable_tensor_transport=True, which the
            # shared test receivers are not: tests/test_rdt.py covers it.
            continue
        availability = get_transport(name).availability()
        marks = [pytest.mark.nixl] if name == "nixl" else []
        if heavy and name != DEFAULT_TRANSPORT and name not in keep:
            marks.append(pytest.mark.slow)
        if not availability.available:
            marks.append(pytest.mark.skip(reason=f"{name} unavailable: {availability.reason}"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


class SharedHubs:
    """One hub (``reject_nonfinite=True``) and one ``Collector`` named ``"w0"`` per
    transport, started on first use and kept for the session.

    For tests that neither kill nor close them: bad input is refused before any receiver
    is touched, so each such test finds the pair as the previous one left it, and checks
    only what changed relative to the version it started from. A pair that stopped
    answering (a test that failed half-way) is replaced.
    """

    def __init__(self) -> None:
        self._pairs: dict[str, tuple] = {}

    def pair(self, transport: str) -> tuple:
        """``(hub, collector)`` on ``transport``, both registered and answering."""
        from tests.receivers import Collector

        if transport in self._pairs and self._answers(*self._pairs[transport]):
            return self._pairs[transport]
        self._kill(transport)
        hub = WeightHub.remote(transport=transport, reject_nonfinite=True)
        collector = Collector.remote(hub, worker_id="w0")
        ready([collector])
        self._pairs[transport] = (hub, collector)
        return hub, collector

    def release_learner_sides(self) -> None:
        """``hub.release()`` on every pair: this process's senders (a NIXL agent, shared-
        memory mappings) are not kept between tests; the next broadcast reopens them."""
        for hub, _ in self._pairs.values():
            hub.release()

    def close(self) -> None:
        for transport in list(self._pairs):
            self._kill(transport)

    @staticmethod
    def _answers(hub, collector) -> bool:
        try:
            ray.get([hub.status.remote(), collector.version.remote()], timeout=30)
        except (ray.exceptions.RayError, RuntimeError):
            return False
        return True

    def _kill(self, transport: str) -> None:
        for handle in self._pairs.pop(transport, ()):
            try:
                ray.kill(getattr(handle, "actor", handle))
            except Exception:  # already dead
                pass


def run_example(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``examples/<script>`` as a user runs it: a fresh interpreter (with a Ray
    cluster of its own: the session's is this process's), in ``cwd``; assert it exits 0
    and return it (``stdout`` and ``stderr`` as text)."""
    result = subprocess.run(
        [sys.executable, str(_ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def cpu_seconds_over_one_idle_second(actor) -> float:
    """Run inside an actor (``actor.__ray_call__.remote(...)``): the CPU seconds its
    process burns while the actor does nothing for one second."""
    start = time.process_time()
    time.sleep(1.0)  # the measured interval, not a wait for anything
    return time.process_time() - start
