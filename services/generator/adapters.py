"""LoRA adapters on the generator: which version of each named adapter is live in an engine (engine-independent;
nothing here imports vLLM, peft or gRPC). What an adapter is, its peft tensor names and the checks it passes before
any engine applies it: :mod:`services.common.lora` (shared with the experience service's forwards).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.lora import AdapterConfig


@dataclass(frozen=True)
class AdapterSlot:
    """One loaded version of a named adapter. ``slot_id`` (> 0) is unique per load in an engine: vLLM's
    ``lora_int_id``, so samples started on an older version keep its weights while newer ones use the new."""

    name: str
    version: int
    slot_id: int
    config: AdapterConfig


class AdapterTable:
    """Which version of each named adapter is live, and which superseded or unloaded versions still have requests
    running.

    One engine owns it and touches it from its event loop only. A request ``acquire``s the live slot of its
    adapter and ``release``s it when done; a superseded slot with no request left is retired (its weights can go).
    """

    def __init__(self) -> None:
        self._live: dict[str, AdapterSlot] = {}
        self._running: Counter[int] = Counter()  # slot id → requests running on it
        self._superseded: dict[int, AdapterSlot] = {}
        self._last_id = 0

    def next_slot(self, name: str, config: AdapterConfig, version: int | None) -> AdapterSlot:
        """A new slot for a load of ``name`` (not live until :meth:`publish`): ``version``, or the live one + 1
        (1 for a first load)."""
        self._last_id += 1
        live = self._live.get(name)
        if version is None:
            version = 1 if live is None else live.version + 1
        return AdapterSlot(name, version, self._last_id, config)

    def publish(self, slot: AdapterSlot) -> list[AdapterSlot]:
        """Make ``slot`` its adapter's live version. Returns the superseded slots that no request runs on (retire
        them now); one with requests running is retired by the :meth:`release` of its last."""
        previous = self._live.get(slot.name)
        self._live[slot.name] = slot
        return [] if previous is None else self._supersede(previous)

    def unload(self, name: str) -> list[AdapterSlot] | None:
        """Take adapter ``name`` out: no request acquires it from now on. Returns ``None`` when no adapter of that
        name is live (nothing changes), else the slots to retire now: its live slot, unless requests run on it,
        which finish on it as on a superseded version (the :meth:`release` of their last retires it)."""
        slot = self._live.pop(name, None)
        return None if slot is None else self._supersede(slot)

    def _supersede(self, slot: AdapterSlot) -> list[AdapterSlot]:
        """``slot`` is no longer live: ``[slot]`` to retire now, or ``[]`` while requests run on it."""
        if self._running[slot.slot_id]:
            self._superseded[slot.slot_id] = slot
            return []
        return [slot]

    def acquire(self, name: str) -> AdapterSlot:
        """The live slot of ``name``, counted as running until :meth:`release`.

        Raises:
            InvalidRequest: ``adapter``: no adapter of that name is loaded.
        """
        slot = self._live.get(name)
        if slot is None:
            raise InvalidRequest("adapter", f"no adapter named {name!r} is loaded (loaded: {sorted(self._live)})")
        self._running[slot.slot_id] += 1
        return slot

    def release(self, slot: AdapterSlot) -> bool:
        """One request on ``slot`` ended; True when the slot is superseded and now idle (retire it)."""
        self._running[slot.slot_id] -= 1
        if self._running[slot.slot_id] > 0:
            return False
        del self._running[slot.slot_id]
        return self._superseded.pop(slot.slot_id, None) is not None

    def live(self) -> dict[str, AdapterSlot]:
        """Each adapter's live slot, by name."""
        return dict(self._live)
