"""The experience tier's state store (issue 42): its cost per stream and per update, and a second replica catching
up with a version made through the first.

Workload: SmolLM2 on the generator (``backend``), two experience replicas on one state store, each replica's
``/metrics`` scraped before and after each step; twice, one after the other: the store an SQLite file (the
embedded default) and a PostgreSQL server started here (Debian's binaries, as the tests start it). A trainer
creates a run, streams ``num_prompts`` x ``n_samples_per_prompt`` samples of ``max_new_tokens`` tokens through
replica A (``reward_running_norm``: one statistics transaction per delivered batch of ``micro_rollout_batch_size``
rows, besides the stream's slot, run and version reads), then sends every tensor of the model through A.

Figures (ratios taken here, in this run):

- ``state_store_vs_stream_s_<backend>``: seconds A spent in store calls during the stream (the sum of
  ``fastexp_state_store_seconds``, waiting for a connection included) / the stream's wall seconds (target <= 0.03);
- ``state_store_vs_update_s_<backend>``: seconds in store calls and in writing the version's blob during the update
  / the update's wall seconds (informative: the blob is a copy of the weights, the rows a few milliseconds);
- ``catch_up_vs_update_s_<backend>``: from the update's answer until replica B reports the new version live (its
  follower's poll every ``state_poll_interval_s``, then the blob read, verified and copied into its actor) / the
  update's wall seconds;
- ``adapter_catch_up_vs_update_s_<backend>``: the same for a LoRA run's adapter (rank ``lora_rank`` on every
  projection, created after the full update: a base update refuses while LoRA runs exist), sent through A, until
  B has loaded it from its blob (``fastexp_catch_ups_total{model="adapter"}``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from fastexp import ExperienceClient, RequestOptions, Sampling
from services.demo.datasets import task_problems
from services.launcher import LocalCluster, free_port


@dataclass(frozen=True)
class StateWorkload:
    """The stream and the update each backend is measured on."""

    task: str = "basic_arithmetic"
    num_prompts: int = 16
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 64
    micro_rollout_batch_size: int = 8
    backend: str = "vllm"
    state_poll_interval_s: float = 0.5
    lora_rank: int = 16
    seed: int = 0


def run(model: str, workload: StateWorkload, log_dir: Path) -> dict:
    """Measure both backends on ``model`` (a local folder); returns the figures, their inputs and the workload."""
    from tests.support.postgres import PostgresServer

    results: dict = {}
    inputs: dict = {}
    postgres = PostgresServer()
    postgres.start()
    try:
        urls = {"sqlite": f"sqlite:///{log_dir / 'state-bench' / 'state.db'}", "postgresql": postgres.create_database()}
        for backend, url in urls.items():
            measured = _measure(model, workload, url, log_dir / f"state-{backend}")
            inputs[backend] = measured
            results[f"state_store_vs_stream_s_{backend}"] = measured["stream_store_s"] / measured["stream_s"]
            results[f"state_store_vs_update_s_{backend}"] = measured["update_state_s"] / measured["update_s"]
            results[f"catch_up_vs_update_s_{backend}"] = measured["catch_up_s"] / measured["update_s"]
            results[f"adapter_catch_up_vs_update_s_{backend}"] = (measured["adapter_catch_up_s"]
                                                                  / measured["adapter_update_s"])
    finally:
        postgres.remove()
    return results | {"state_inputs": inputs, "state_workload": asdict(workload)}


def _measure(model: str, workload: StateWorkload, state_url: str, log_dir: Path) -> dict:
    options = RequestOptions(
        n_samples_per_prompt=workload.n_samples_per_prompt, advantage_estimator="rloo", reward_running_norm=True,
        micro_rollout_batch_size=workload.micro_rollout_batch_size, run_id="bench",
        sampling=Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, ignore_eos=True),
    )
    prompts = [list(p.messages) for p in task_problems(workload.task, workload.num_prompts, seed=workload.seed)]
    weights = list(load_file(str(Path(model) / "model.safetensors")).items())
    with _services(model, workload, state_url, log_dir) as (cluster, metrics_a, metrics_b):
        with ExperienceClient(cluster.address("experience")) as client:
            client.create_run("bench")
            before = _sums(metrics_a)
            started = time.perf_counter()
            rows = sum(len(e.reward) for e in client.make_experiences(prompts, options))
            stream_s = time.perf_counter() - started
            after_stream = _sums(metrics_a)
            started = time.perf_counter()
            version = client.update_weights(weights).policy_version
            update_s = time.perf_counter() - started
            after_update = _sums(metrics_a)
        answered = time.perf_counter()
        while _version(metrics_b) != version:  # B's follower loads it from the blob
            time.sleep(0.02)
        catch_up_s = time.perf_counter() - answered
        adapter_update_s, adapter_catch_up_s = _adapter_catch_up(cluster.address("experience"), model, workload,
                                                                 metrics_b)
    return {
        "rows": rows, "stream_s": stream_s, "update_s": update_s, "catch_up_s": catch_up_s,
        "adapter_update_s": adapter_update_s, "adapter_catch_up_s": adapter_catch_up_s,
        "stream_store_s": after_stream["store"] - before["store"],
        "stream_store_calls": after_stream["calls"] - before["calls"],
        "update_state_s": (after_update["store"] - after_stream["store"]) + (after_update["blob"] - after_stream["blob"]),
    }


def _adapter_catch_up(address: str, model: str, workload: StateWorkload, metrics_b: str) -> tuple[float, float]:
    """A LoRA run's adapter sent through A: the update's wall seconds, then the seconds until B has it live."""
    from benchmarks.runs import random_adapter
    from services.common.lora import AdapterConfig
    from services.experience.runs.limits import DEFAULT_LORA_TARGET_MODULES

    config = AdapterConfig(workload.lora_rank, float(workload.lora_rank), DEFAULT_LORA_TARGET_MODULES)
    tensors = list(random_adapter(model, config, seed=workload.seed + 1).items())
    loaded = _catch_ups(metrics_b)
    with ExperienceClient(address) as client:
        client.create_run("bench-lora", lora_rank=config.rank, lora_alpha=config.alpha,
                          target_modules=list(config.target_modules))
        started = time.perf_counter()
        version = client.update_weights(tensors, run_id="bench-lora").policy_version
        update_s = time.perf_counter() - started
    answered = time.perf_counter()
    while _catch_ups(metrics_b) == loaded:  # B's follower loads it from its blob
        time.sleep(0.02)
    assert version == 1
    return update_s, time.perf_counter() - answered


@contextlib.contextmanager
def _services(model: str, workload: StateWorkload, state_url: str, log_dir: Path) -> Iterator[tuple]:
    """Generator, scorer and two experience replicas on ``state_url``, warmed up; yields the cluster and each
    replica's metrics URL."""
    ports = {"experience": free_port(), "experience-1": free_port()}
    overrides = {
        "generator": {"model": model, "backend": workload.backend},
        "experience": {"actor_model": model, "reference_model": model, "state_url": state_url,
                       "weights_dir": str(log_dir / "weights"), "state_poll_interval_s": workload.state_poll_interval_s},
        "experience-1": {"metrics_port": ports["experience-1"]},
    }
    overrides["experience"]["metrics_port"] = ports["experience"]
    with LocalCluster(overrides=overrides, log_dir=log_dir, experience_replicas=2) as cluster:
        with ExperienceClient(cluster.address("experience")) as client:
            client.wait_until_ready(900)
            for _ in client.make_experiences([[{"role": "user", "content": "Hi"}]], n_samples_per_prompt=2,
                                             advantage_estimator="rloo", sampling=Sampling(max_new_tokens=8)):
                pass  # warm-up
        yield cluster, *(f"http://127.0.0.1:{port}/metrics" for port in ports.values())


def _families(url: str):
    return text_string_to_metric_families(httpx.get(url, timeout=10).text)


def _sums(url: str) -> dict[str, float]:
    """Seconds in store calls and blob operations so far, and the number of store calls."""
    sums = {"store": 0.0, "blob": 0.0, "calls": 0.0}
    for family in _families(url):
        for sample in family.samples:
            if sample.name == "fastexp_state_store_seconds_sum":
                sums["store"] += sample.value
            elif sample.name == "fastexp_state_store_seconds_count":
                sums["calls"] += sample.value
            elif sample.name == "fastexp_weights_blob_seconds_sum":
                sums["blob"] += sample.value
    return sums


def _version(url: str) -> int | None:
    for family in _families(url):
        for sample in family.samples:
            if sample.name == "fastexp_policy_version" and sample.labels.get("service") == "experience":
                return int(sample.value)
    return None


def _catch_ups(url: str) -> float:
    """Adapters the replica loaded from blobs made through another replica, so far."""
    return sum(sample.value for family in _families(url) for sample in family.samples
               if sample.name == "fastexp_catch_ups_total" and sample.labels.get("model") == "adapter")
