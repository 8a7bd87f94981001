"""Two experience replicas against one on a forward-bound workload (issue 42), and what a replica costs.

Workload: two trainers at once, each streaming ``num_prompts`` x ``n_samples_per_prompt`` samples of a long prompt
(``prompt_words`` words of context, then a question) and a short response (``max_new_tokens``), with the actor and
reference forwards (``kl_coef`` > 0): the forwards over the whole sequences cost more than generating a few tokens
after the engine's prefill, so the experience tier is the bottleneck, the situation in which one adds replicas.
One cluster per run (a vLLM generator, the scorer, one SQLite state store):

- ``one_replica``: one experience service serves both trainers;
- ``two_replicas``: two experience services on one state store, a trainer on each.

Figures (ratios taken here, in this run):

- ``replicas_two_vs_one_rows_per_s``: rows/s with two replicas / rows/s with one (informative: where each replica
  has cores of its own it approaches 2; on a host whose cores the engine and one replica's forwards already fill,
  a second replica only shares them, and the ratio shows the cost of running two);
- ``replica_rss_gib``: resident memory of one experience replica after the run (its actor and reference copies,
  torch, the gRPC server), the price of each replica added;
- ``replica_store_calls_per_stream``: state-store calls one replica made per stream (the store's share of a
  replica's work, read from its ``fastexp_state_store_seconds`` histogram).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fastexp import ExperienceClient, RequestOptions, Sampling
from services.launcher import LocalCluster, free_port


@dataclass(frozen=True)
class ReplicasWorkload:
    """What each of the two trainers streams."""

    num_prompts: int = 8
    n_samples_per_prompt: int = 4
    prompt_words: int = 300
    max_new_tokens: int = 16
    backend: str = "vllm"


def run(model: str, workload: ReplicasWorkload, log_dir: Path) -> dict:
    """Measure both runs on ``model`` (a local folder); returns the figures, their inputs and the workload."""
    inputs = {name: _measure(model, workload, replicas, log_dir / f"replicas-{replicas}")
              for name, replicas in (("one_replica", 1), ("two_replicas", 2))}
    one, two = inputs["one_replica"], inputs["two_replicas"]
    return {
        "replicas_two_vs_one_rows_per_s": (two["rows"] / two["wall_s"]) / (one["rows"] / one["wall_s"]),
        "replica_rss_gib": max(two["rss_gib"]),
        "replica_store_calls_per_stream": two["store_calls"] / 2,
        "replicas_inputs": inputs, "replicas_workload": asdict(workload),
    }


def _measure(model: str, workload: ReplicasWorkload, replicas: int, log_dir: Path) -> dict:
    names = ("experience", "experience-1")[:replicas]
    ports = {name: free_port() for name in names}
    overrides = {
        "generator": {"model": model, "backend": workload.backend},
        "experience": {"actor_model": model, "reference_model": model, "state_url": f"sqlite:///{log_dir / 'state.db'}",
                       "weights_dir": str(log_dir / "weights")},
        **{name: {"metrics_port": port} for name, port in ports.items()},
    }
    context = " ".join(f"w{i}" for i in range(workload.prompt_words))
    prompts = [f"{context}\nQuestion {i}: what is {i} + {i}?" for i in range(workload.num_prompts)]
    options = RequestOptions(
        n_samples_per_prompt=workload.n_samples_per_prompt, advantage_estimator="rloo", kl_coef=0.01,
        micro_rollout_batch_size=workload.n_samples_per_prompt,
        sampling=Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, ignore_eos=True),
    )
    with LocalCluster(overrides=overrides, log_dir=log_dir, experience_replicas=replicas) as cluster:
        for name in names:  # warm-up: each replica's first forward
            with ExperienceClient(cluster.address(name)) as client:
                list(client.make_experiences(prompts[:1], options))
        rows, errors = [0, 0], []

        def trainer(i: int) -> None:
            try:
                with ExperienceClient(cluster.address(names[i % replicas])) as client:
                    rows[i] = sum(len(e.reward) for e in client.make_experiences(prompts, options))
            except Exception as error:  # noqa: BLE001 - reported below, after both trainers ended
                errors.append(error)

        before = sum(_store_calls(port) for port in ports.values())
        started = time.perf_counter()
        threads = [threading.Thread(target=trainer, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall_s = time.perf_counter() - started
        if errors:
            raise errors[0]
        store_calls = sum(_store_calls(port) for port in ports.values()) - before
        rss = [_rss_gib(cluster.processes[name].pid) for name in names]
    return {"rows": sum(rows), "wall_s": wall_s, "store_calls": store_calls, "rss_gib": rss}


def _store_calls(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "fastexp_state_store_seconds_count")


def _rss_gib(pid: int) -> float:
    """Resident memory of process ``pid`` (``VmRSS``), GiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024**2
    return float("nan")
