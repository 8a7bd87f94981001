"""Unloading a LoRA adapter (issue 33): the generator's adapter table, its peft layers when the last adapter goes,
the name check UnloadAdapter shares with LoadAdapter, and how the fleet sorts its replicas' answers."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequest, NotReady
from services.common.lora import PEFT_PREFIX, AdapterConfig, check_name
from services.experience.fleet.adapters import UnloadOutcome, unload_outcome
from services.generator.adapters import AdapterTable
from services.generator.hf_adapters import PeftAdapters

CONFIG = AdapterConfig(2, 4.0, ("q_proj",))


def test_an_idle_adapter_is_retired_at_once_and_gone_from_the_table():
    table = AdapterTable()
    other = table.next_slot("other", CONFIG, None)
    table.publish(other)
    slot = table.next_slot("a", CONFIG, 3)
    table.publish(slot)
    assert table.unload("a") == [slot]
    assert table.live() == {"other": other}
    with pytest.raises(InvalidRequest, match="no adapter named 'a'"):
        table.acquire("a")
    assert table.unload("a") is None  # idempotent: nothing of that name is loaded
    assert table.next_slot("a", CONFIG, None).version == 1  # loaded again later: a first load


def test_requests_running_on_an_unloaded_adapter_finish_on_it_and_the_last_retires_it():
    table = AdapterTable()
    old = table.next_slot("a", CONFIG, None)
    table.publish(old)
    on_old = table.acquire("a")
    live = table.next_slot("a", CONFIG, None)
    table.publish(live)  # the old version keeps its request
    first, second = table.acquire("a"), table.acquire("a")
    assert table.unload("a") == []  # requests run on it: retired by the last release
    assert table.live() == {}
    assert table.release(first) is False
    assert table.release(second) is True  # the unloaded version, idle now
    assert table.release(on_old) is True  # the superseded one as before


def test_an_adapter_name_is_checked_naming_the_field():
    check_name("alice-lora.v2_x")
    check_name("x" * 256)
    for malformed in ("", "-a", "../etc", "a b", "x" * 257):
        with pytest.raises(InvalidRequest) as raised:
            check_name(malformed, "name")
        assert raised.value.field == "name"


def test_the_fleet_sorts_each_replicas_answer():
    outcome = unload_outcome(["a:1", "b:1", "c:1", "d:1"], [True, False, NotReady("generator c:1: down"), TimeoutError()])
    assert outcome == UnloadOutcome(("a:1",), ("b:1",), {"c:1": "generator c:1: down", "d:1": "TimeoutError"})
    assert unload_outcome([], []) == UnloadOutcome()


class _Tiny(torch.nn.Module):
    """One LoRA-able linear layer named as a checkpoint's (``layer.q_proj``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Module()
        self.layer.q_proj = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.q_proj(x)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{PEFT_PREFIX}layer.q_proj.lora_A.weight": torch.randn(2, 4, generator=g),  # (rank, in)
            f"{PEFT_PREFIX}layer.q_proj.lora_B.weight": torch.randn(3, 2, generator=g)}  # (out, rank)


@torch.no_grad()
def test_removing_the_last_peft_adapter_leaves_the_base_and_room_for_the_next():
    torch.manual_seed(0)
    model = _Tiny().eval()
    x = torch.randn(5, 4)
    base = model(x)
    adapters, table = PeftAdapters(model), AdapterTable()
    first = table.next_slot("a", CONFIG, None)
    adapters.add(first, _tensors(1))
    with adapters.active(first):
        a, b = _tensors(1).values()
        torch.testing.assert_close(model(x), base + CONFIG.scaling * x @ a.T @ b.T)  # W x + scaling * B A x
    adapters.remove(first)  # the only one, active
    with adapters.active(None):
        torch.testing.assert_close(model(x), base)
    torch.testing.assert_close(model(x), base)  # no adapter left to apply
    second = table.next_slot("b", CONFIG, None)
    adapters.add(second, _tensors(2))
    with adapters.active(second):
        a, b = _tensors(2).values()
        torch.testing.assert_close(model(x), base + CONFIG.scaling * x @ a.T @ b.T)
    with adapters.active(None):
        torch.testing.assert_close(model(x), base)
