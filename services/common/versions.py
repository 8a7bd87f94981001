"""The records of live versions, shared by the pipeline's weight sync (which asks for them) and the state store
(which issues them): what is live, where its weights are, and an update's claim. Plain frozen values."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.lora import AdapterConfig


@dataclass(frozen=True)
class Live:
    """A live version (0: nothing sent yet: the model folder, or no adapter), the digest of its weights' blob
    (``sha256:<hex>``; None: not by reference, or version 0), and whether an update of it is being applied."""

    version: int = 0
    weights_digest: str | None = None
    updating: bool = False


@dataclass(frozen=True)
class Snapshot:
    """Every live version at one moment: the deployment's ``policy`` and ``critic``, and each LoRA run's adapter
    and its config by run id."""

    policy: Live = Live()
    critic: Live = Live()
    adapters: dict[str, Live] = field(default_factory=dict)
    configs: dict[str, AdapterConfig] = field(default_factory=dict)  # each LoRA run's adapter config


@dataclass(frozen=True)
class Claim:
    """An update in progress: its id, what it updates (``target``: ``policy`` or ``critic``; or ``run_id``, a LoRA
    run's adapter) and the version live when it was claimed."""

    claim_id: str
    live: Live
    target: str | None = None
    run_id: str | None = None
