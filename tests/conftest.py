"""Shared fixtures: real models (the embedded SmolLM2 and a tiny Llama built here) and in-process services."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.models import SMOLLM2_ALIAS, resolve_model


@pytest.fixture(scope="module", autouse=True)
def experience_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Each test module's own durable experience state (an SQLite file and a weights folder): the experience
    services a module starts, in process or as subprocesses, share it (restarts keep it), and no module sees
    another's runs or versions."""
    root = tmp_path_factory.mktemp("experience-state")
    url = f"sqlite:///{root / 'state.db'}"
    values = {"FASTEXP_EXPERIENCE_STATE_URL": url, "FASTEXP_EXPERIENCE_WEIGHTS_DIR": str(root / "weights")}
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    yield url
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def state_store(tmp_path: Path):
    """A real state store of the test's own: an SQLite file, migrated."""
    from services.experience.state.store import StateStore

    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}", timeout_s=5.0)
    store.migrate()
    yield store
    store.close()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded SmolLM2-135M-Instruct as a bf16 safetensors folder (converted from its GGUF once)."""
    return resolve_model(SMOLLM2_ALIAS)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    """A randomly initialised 2-layer Llama (head_dim 32, as vLLM's CPU attention needs >= 32) with SmolLM2's
    real tokenizer and chat template, saved as float32 safetensors. Built, not downloaded."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    path: Path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def reward_model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    """A randomly initialised 2-layer Llama sequence classifier (one label) with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    path = tmp_path_factory.mktemp("tiny-rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small random Qwen2-VL (real classes, processor and Qwen tokenizer; see tests/support/vlm.py)."""
    from tests.support.vlm import build_tiny_qwen2_vl

    return str(build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl")))


@pytest.fixture(scope="module")
def postgres():
    """A real PostgreSQL server of the module's own (:class:`tests.support.postgres.PostgresServer`), started;
    removed after the module."""
    from tests.support.postgres import PostgresServer

    server = PostgresServer()
    server.start()
    yield server
    server.remove()
