"""Zero-copy adoption (raysync/receiver_zero_copy.py) without Ray.

A model's tensors rebound to staged views (the same Python objects, new storage), models
that cannot be rebound left untouched (another device, reached only through
``state_dict()``), the version a model leaves handed back to its transport, and a
refusal logged once per model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from raysync.receiver_zero_copy import AdoptedVersion, Adoption, rebind
from raysync.spec import WeightSpec
from raysync.transports import TransportReceiver

NAMES = ("bias", "weight")  #: nn.Linear's tensors in spec order


class _Transport(TransportReceiver):
    """Records which payloads were handed back."""

    def __init__(self) -> None:
        self.released: list[Any] = []

    def fetch(self, payload: Any, spec: WeightSpec) -> Sequence[torch.Tensor]:
        raise AssertionError("adoption never fetches")

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        self.released.append(payload)


def _staged(fill: float, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.full((2,), fill, device=device), torch.full((2, 3), fill, device=device)]


def test_rebind_points_each_tensor_at_its_view_and_keeps_the_objects():
    model = torch.nn.Linear(3, 2)
    weight, bias = model.weight, model.bias
    staged = _staged(7.0)
    assert rebind(model, NAMES, staged) is None
    assert model.weight is weight and model.bias is bias
    assert model.bias.data_ptr() == staged[0].data_ptr()
    assert model.weight.data_ptr() == staged[1].data_ptr()
    assert torch.equal(model.weight, torch.full((2, 3), 7.0))


def test_rebind_refuses_staged_data_on_another_device_and_changes_nothing():
    model = torch.nn.Linear(3, 2)
    pointers = [model.bias.data_ptr(), model.weight.data_ptr()]
    assert rebind(model, NAMES, _staged(7.0, device="meta")) == (
        "'bias' is on cpu, the staged data on meta"
    )
    assert [model.bias.data_ptr(), model.weight.data_ptr()] == pointers


def test_rebind_refuses_a_model_reached_only_through_state_dict():
    class Wrapped:
        def __init__(self) -> None:
            self._net = torch.nn.Linear(3, 2)

        def state_dict(self) -> dict[str, torch.Tensor]:
            return self._net.state_dict()

        def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
            self._net.load_state_dict(state)

    assert rebind(Wrapped(), NAMES, _staged(7.0)) == "its tensors are reached only by copying"


def test_taking_a_version_releases_the_one_the_model_leaves():
    transport, model, adoption = _Transport(), torch.nn.Linear(3, 2), Adoption()
    first = AdoptedVersion(transport, "v1", _staged(1.0))
    second = AdoptedVersion(transport, "v2", _staged(2.0))
    assert adoption.take(model, NAMES, first, actor="Collector(a)", model_id="policy")
    assert adoption.lives_in(first.staged) and transport.released == []
    assert adoption.take(model, NAMES, second, actor="Collector(a)", model_id="policy")
    assert adoption.lives_in(second.staged) and not adoption.lives_in(first.staged)
    assert transport.released == ["v1"]
    assert torch.equal(model.bias, torch.full((2,), 2.0))


def test_a_refused_take_moves_the_model_out_of_its_version_and_warns_once(caplog):
    """The model is copied into from now on: not into the version it lives in (a
    transport's memory: read-only, or shared with other receivers), which goes back."""
    transport, model, adoption = _Transport(), torch.nn.Linear(3, 2), Adoption()
    first = AdoptedVersion(transport, "v1", _staged(1.0))
    assert adoption.take(model, NAMES, first, actor="Collector(a)", model_id="policy")
    with caplog.at_level(logging.WARNING, logger="raysync.receiver_zero_copy"):
        for payload in ("v2", "v3"):
            elsewhere = AdoptedVersion(transport, payload, _staged(2.0, device="meta"))
            assert not adoption.take(
                model, NAMES, elsewhere, actor="Collector(a)", model_id="policy"
            )
    assert adoption.current is None and adoption.copies_instead
    assert transport.released == ["v1"]
    assert model.bias.data_ptr() != first.staged[0].data_ptr()
    assert model.weight.data_ptr() != first.staged[1].data_ptr()
    assert torch.equal(model.weight, torch.full((2, 3), 1.0))
    assert [r.getMessage() for r in caplog.records] == [
        "Collector(a): zero_copy is off for model 'policy' ('bias' is on cpu, the staged "
        "data on meta); its updates are copied"
    ]


def test_a_model_partly_moved_is_copied_into_memory_of_its_own_only():
    """The host moved one tensor (here to meta): the next take is refused, and the
    tensor still in the version's memory must get its own before the copy writes it."""
    transport, model, adoption = _Transport(), torch.nn.Linear(3, 2), Adoption()
    first = AdoptedVersion(transport, "v1", _staged(1.0))
    assert adoption.take(model, NAMES, first, actor="Collector(a)", model_id="policy")
    model.bias = torch.nn.Parameter(model.bias.detach().to("meta"))
    second = AdoptedVersion(transport, "v2", _staged(2.0))
    assert not adoption.take(model, NAMES, second, actor="Collector(a)", model_id="policy")
    assert adoption.current is None and transport.released == ["v1"]
    assert model.weight.data_ptr() != first.staged[1].data_ptr()
    assert torch.equal(model.weight, torch.full((2, 3), 1.0))


def test_a_model_the_host_moved_hands_back_the_version_it_left():
    """The host moved the model off the staged version (to another device, here meta):
    the next take is refused and the model is copied into as usual, and the version it
    no longer lives in went back to its transport (it was held for good, a shared-memory
    slot among them); leaving the hub then has nothing to copy (it raised)."""
    transport, model, adoption = _Transport(), torch.nn.Linear(3, 2), Adoption()
    first = AdoptedVersion(transport, "v1", _staged(1.0))
    assert adoption.take(model, NAMES, first, actor="Collector(a)", model_id="policy")
    model.to("meta")
    second = AdoptedVersion(transport, "v2", _staged(2.0))
    assert not adoption.take(model, NAMES, second, actor="Collector(a)", model_id="policy")
    assert adoption.current is None and transport.released == ["v1"]
    adoption.keep_privately(model)
    assert transport.released == ["v1"]


def test_leaving_the_hub_after_the_host_moved_the_model_hands_its_version_back():
    transport, model, adoption = _Transport(), torch.nn.Linear(3, 2), Adoption()
    first = AdoptedVersion(transport, "v1", _staged(1.0))
    assert adoption.take(model, NAMES, first, actor="Collector(a)", model_id="policy")
    model.to("meta")
    adoption.keep_privately(model)
    assert adoption.current is None and transport.released == ["v1"]



def test_leaving_the_hub_after_the_host_changed_part_of_the_model_keeps_its_changes():
    """The host moved one tensor out of the version's memory (cast it, here): leaving
    the hub rebound every tensor to a copy of the version, which undid the cast and the
    values written since. Only the tensors still in the version's memory get a copy of
    their own."""
    transport, model, adoption = _Transport(), torch.nn.Linear(3, 2), Adoption()
    first = AdoptedVersion(transport, "v1", _staged(1.0))
    assert adoption.take(model, NAMES, first, actor="Collector(a)", model_id="policy")
    with torch.no_grad():
        model.weight.data = model.weight.data.double()
        model.weight.fill_(42.0)
    adoption.keep_privately(model)
    assert transport.released == ["v1"]
    assert torch.equal(model.weight, torch.full((2, 3), 42.0, dtype=torch.float64))
    assert model.bias.data_ptr() != first.staged[0].data_ptr()
    assert torch.equal(model.bias, torch.full((2,), 1.0))


def test_leaving_the_hub_after_the_host_moved_part_of_the_model_to_a_device():
    """It raised (a tensor on another device cannot be rebound to the copy), and the
    receiver's leave with it."""
    transport, model, adoption = _Transport(), torch.nn.Linear(3, 2), Adoption()
    first = AdoptedVersion(transport, "v1", _staged(1.0))
    assert adoption.take(model, NAMES, first, actor="Collector(a)", model_id="policy")
    model.weight = torch.nn.Parameter(model.weight.detach().to("meta"))
    adoption.keep_privately(model)
    assert transport.released == ["v1"] and model.weight.device.type == "meta"
    assert model.bias.data_ptr() != first.staged[0].data_ptr()
    assert torch.equal(model.bias, torch.full((2,), 1.0))


def test_a_refused_take_whose_move_out_fails_still_knows_the_version_the_model_lives_in(
    monkeypatch,
):
    """The copy out of the version the model lived in failed halfway (out of memory):
    the version was forgotten first, so it was never handed back, and leaving the hub
    later left the tensors still in it there (a slot written again under them)."""
    import raysync.receiver_zero_copy as zero_copy

    transport, model, adoption = _Transport(), torch.nn.Linear(3, 2), Adoption()
    first = AdoptedVersion(transport, "v1", _staged(1.0))
    assert adoption.take(model, NAMES, first, actor="Collector(a)", model_id="policy")
    move_out = zero_copy._move_out

    def out_of_memory_after_one(model: Any, names: tuple[str, ...], staged: Any) -> None:
        move_out(model, names[:1], staged)
        raise torch.OutOfMemoryError("no memory for 'weight'")

    monkeypatch.setattr(zero_copy, "_move_out", out_of_memory_after_one)
    elsewhere = AdoptedVersion(transport, "v2", _staged(2.0, device="meta"))
    with pytest.raises(torch.OutOfMemoryError, match="no memory for 'weight'"):
        adoption.take(model, NAMES, elsewhere, actor="Collector(a)", model_id="policy")
    assert adoption.current is first and transport.released == []
    monkeypatch.setattr(zero_copy, "_move_out", move_out)
    adoption.keep_privately(model)  # leaving the hub: the rest moves out, v1 goes back
    assert transport.released == ["v1"]
    assert model.weight.data_ptr() != first.staged[1].data_ptr()
    assert torch.equal(model.weight, torch.full((2, 3), 1.0))


def test_rebind_refuses_inference_tensors_and_changes_nothing():
    """A model made under torch.inference_mode(): setting ``.data`` of its first tensor
    raised torch's error, after earlier ones of a longer model were pointed at the
    version. It is copied into instead."""
    with torch.inference_mode():
        model = torch.nn.Linear(3, 2)
    pointers = [model.bias.data_ptr(), model.weight.data_ptr()]
    assert rebind(model, NAMES, _staged(7.0)) == (
        "'bias' is an inference tensor (made under torch.inference_mode())"
    )
    assert [model.bias.data_ptr(), model.weight.data_ptr()] == pointers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_version_is_handed_back_once_the_kernels_reading_it_ran():
    """The model lived in the staged VRAM until now, and the host's last forward pass
    may still be queued on a stream reading it: handed back at once, a NIXL READ of the
    next version (DMA, which waits for no stream) could land under those kernels."""
    idle_at_release: list[bool] = []

    class _Recording(_Transport):
        def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
            idle_at_release.append(torch.cuda.current_stream().query())
            super().release(payload, staged)

    transport = _Recording()
    model = torch.nn.Linear(3, 2).cuda()
    adoption = Adoption()
    first = AdoptedVersion(transport, "v1", _staged(1.0, "cuda"), 1)
    assert adoption.take(model, NAMES, first, actor="A", model_id="m")
    torch.cuda._sleep(10**9)  # a long kernel queued, as a forward pass would be
    model(torch.ones(1, 3, device="cuda"))
    second = AdoptedVersion(transport, "v2", _staged(2.0, "cuda"), 2)
    assert adoption.take(model, NAMES, second, actor="A", model_id="m")
    assert transport.released == ["v1"] and idle_at_release == [True]
