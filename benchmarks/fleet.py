"""Two generator replicas against one, on the same workload (ratio 8; issue 22, target >= 1.8).

Workload: 32 reasoning-gym ``gsm_symbolic`` chat prompts x 4 samples at temperature 1, up to 128 new tokens,
seeded (vLLM seeds each sample with ``seed + sample_index``, so both runs sample the same tokens whichever replica
runs a group: the same work). Each engine runs at most ``max_num_seqs`` = 16 sequences per step, so one engine is
at capacity with the 128 sequences queued (the situation in which one adds replicas), and the experience service
sends each replica at most that many samples at once (``generator_max_samples_in_flight``: groups go to whichever
replica frees up first); with room to spare in its
batch, a CPU engine batches more sequences almost for free and a second replica gains little (README,
Benchmarks). The stream is generation-bound on purpose (``skip_actor_forward`` and ``kl_coef`` 0: no forward
passes), so what is compared is the fleet's generation throughput.

Set-up, one :class:`~services.launcher.LocalCluster`: two vLLM generator replicas, each confined to its own core
(CPU affinity of its whole process tree, and ``VLLM_CPU_OMP_THREADS_BIND`` for the model's threads:
:class:`~services.launcher.CoreSplit` with ``pin_generators``), the scorer, and the experience service routing over
both (one forward thread). Without the affinity, vLLM's scheduler process of a lone replica runs on the other core
(a second core's worth of CPU, measured) and "one replica" is not one core. Runs, in this order:

- ``two_replicas``: the stream over the fleet of two.
- ``one_replica``: replica 1 is SIGKILLed, the fleet takes it out, and the same stream runs on replica 0 alone
  (the same engine, the same core).

Figures: ``fleet_two_vs_one_replica`` = tokens/s of ``two_replicas`` / tokens/s of ``one_replica`` (target >=
1.8), and each run's time to the first ``ExperienceBatch`` (``fleet_first_batch_s``). ``fleet_cpu_seconds`` says
where the two cores went in each run: CPU seconds of each generator's server process (gRPC, vLLM's output
processing) and of its engine processes (scheduler and model), of the experience service and of the scorer.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.stream_overhead import _stream
from fastexp import RequestOptions, Sampling
from services.demo.datasets import task_problems
from services.launcher import CoreSplit, LocalCluster, free_port, fresh_state_dir


@dataclass(frozen=True)
class FleetWorkload:
    """The stream both runs make, and the engines' backend (``hf`` only for the smoke test)."""

    task: str = "gsm_symbolic"
    num_prompts: int = 32
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 128
    max_num_seqs: int = 16  # per engine (vLLM)
    seed: int = 0
    backend: str = "vllm"


def run(model: str, workload: FleetWorkload, log_dir: Path) -> dict:
    """Measure the two runs on ``model`` (a local folder); returns the figure, its inputs and the workload."""
    problems = task_problems(workload.task, workload.num_prompts, seed=workload.seed)
    sampling = Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, seed=workload.seed)
    options = RequestOptions(
        n_samples_per_prompt=workload.n_samples_per_prompt, sampling=sampling, advantage_estimator="group_norm",
        skip_actor_forward=True, kl_coef=0.0,
    )
    metrics_port = free_port()
    overrides = {
        "generator": {"model": model, "backend": workload.backend, "max_num_seqs": workload.max_num_seqs},
        "experience": {"actor_model": model, "reference_model": model, "metrics_port": metrics_port,
                       "upstream_probe_interval_s": 0.5, "generator_down_after_failures": 1,
                       "generator_max_samples_in_flight": workload.max_num_seqs},
    }
    with LocalCluster(overrides=overrides, log_dir=log_dir / "fleet", generator_replicas=2,
                      state_dir=fresh_state_dir(log_dir / "fleet-state"),
                      core_split=CoreSplit(engine_cores=(0, 1), forward_threads=1, pin_generators=True)) as cluster:
        address = cluster.address("experience")
        _stream(address, problems[:2], RequestOptions(n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=8),
                                                       skip_actor_forward=True, kl_coef=0.0))  # warm-up
        before = _cpu_seconds(cluster)
        two = _stream(address, problems, options)
        cpu_two = _difference(_cpu_seconds(cluster), before)
        cluster.kill("generator-1")
        _wait_replicas_up(metrics_port, 1)
        before = _cpu_seconds(cluster)
        one = _stream(address, problems, options)
        cpu_one = _difference(_cpu_seconds(cluster), before)
    return {
        "fleet_two_vs_one_replica": two["tokens_per_s"] / one["tokens_per_s"],
        "fleet_first_batch_s": {"two_replicas": two["first_batch_s"], "one_replica": one["first_batch_s"]},
        "fleet_cpu_seconds": {"two_replicas": cpu_two, "one_replica": cpu_one},
        "fleet_inputs": {"two_replicas": two, "one_replica": one},
        "fleet_workload": {**asdict(workload), "model": model, "engine_cores": "replica 0: core 0, replica 1: core 1"},
    }


def _cpu_seconds(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds (user + system) so far of each running service process and, for generators, of its children
    (vLLM's engine processes) as ``<name> engine``."""
    import psutil

    seconds: dict[str, float] = {}
    for name, process in cluster.processes.items():
        if process.poll() is not None:
            continue
        try:
            parent = psutil.Process(process.pid)
            times = parent.cpu_times()
            seconds[name] = times.user + times.system
            children = [c.cpu_times() for c in parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        if children:
            seconds[f"{name} engine"] = sum(t.user + t.system for t in children)
    return seconds


def _difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before.get(name, 0.0), 1) for name in after}


def _wait_replicas_up(metrics_port: int, count: int, timeout_s: float = 60.0) -> None:
    """Wait until the experience service routes to exactly ``count`` replicas (its ``replica_up`` gauges)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        up = sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                 if sample.name == "fastexp_generator_replica_up")
        if up == count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{up} generator replicas up after {timeout_s} s, not {count}")
        time.sleep(0.25)
