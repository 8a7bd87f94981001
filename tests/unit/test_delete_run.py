"""DeleteRun of a LoRA run against its adapter's updates (issue 33): refused naming ``run_id`` while an update of
the adapter is in progress; once accepted, the adapter is freed to the end even if the call is cancelled, and the
run id stays busy for updates until it is. RunMethods over a real RunRegistry; the freeing of the adapter is a gate
the test opens."""

from __future__ import annotations

import asyncio

import pytest

from fastexp.errors import NotFound, Overloaded
from fastexp.v1 import experience_pb2
from services.common.identity import ANONYMOUS
from services.experience.api.runs import RunMethods
from services.experience.runs.limits import LoraSpec, OperatorLimits, RunLimits
from services.experience.runs.registry import Run, RunRegistry
from services.experience.state.store import StateStore


class Runs(RunMethods):
    """The run RPCs with the servicer's hooks: an adapter's freeing waits for ``gate``."""

    def __init__(self, store: StateStore) -> None:
        self._runs = RunRegistry(OperatorLimits(), store)
        self._updating = set()
        self.gate = asyncio.Event()
        self.freeing: list[str] = []
        self.freed: list[str] = []

    def _policy_version(self, run: Run) -> int:
        return 1

    def _served_lora_rank(self) -> int:
        return 16

    def _share_usage(self, run_id: str) -> tuple[int, int]:
        return 0, 0

    async def _run_deleted(self, run: Run) -> None:
        self.freeing.append(run.run_id)
        await self.gate.wait()
        self.freed.append(run.run_id)

    async def create(self, run_id: str, lora: bool = True) -> None:
        spec = LoraSpec(4, 4.0, ("q_proj",)) if lora else None
        await self._runs.create(run_id, ANONYMOUS, spec, RunLimits(0, 0, 0, 0), self._served_lora_rank)

    async def delete(self, run_id: str) -> experience_pb2.Run:
        return await self.DeleteRun(experience_pb2.DeleteRunRequest(run_id=run_id), None)


@pytest.fixture
def store(state_store):
    return state_store


async def _until(condition) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0)


async def test_a_lora_run_is_not_deleted_while_its_adapter_is_being_updated(store):
    runs = Runs(store)
    await runs.create("r")
    runs._updating.add("r")  # what UpdateWeights holds from its authorization to its answer
    with pytest.raises(Overloaded, match="^run_id: run 'r'.s adapter is being updated"):
        await runs.delete("r")
    assert (await runs._runs.get("r", ANONYMOUS)).run.run_id == "r" and runs.freeing == []
    runs._updating.discard("r")
    runs.gate.set()
    assert (await runs.delete("r")).run_id == "r" and runs.freed == ["r"]
    with pytest.raises(NotFound):
        await runs._runs.get("r", ANONYMOUS)


async def test_a_cancelled_delete_still_frees_the_adapter_and_the_id_stays_busy_until_then(store):
    runs = Runs(store)
    await runs.create("r")
    deleting = asyncio.create_task(runs.delete("r"))
    await _until(lambda: runs.freeing == ["r"])
    deleting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await deleting
    with pytest.raises(NotFound):  # gone from the registry: a new run of that id may be created ...
        await runs._runs.get("r", ANONYMOUS)
    assert "r" in runs._updating  # ... but its first update waits until the old adapter is freed
    runs.gate.set()
    await _until(lambda: runs.freed == ["r"])
    await _until(lambda: "r" not in runs._updating)


async def test_a_base_model_run_is_deleted_at_once(store):
    runs = Runs(store)
    await runs.create("base", lora=False)
    runs._updating.add("")  # a base-model update in progress does not concern it
    assert (await runs.delete("base")).run_id == "base" and runs.freeing == []
