"""Two LoRA runs on one generator: an adapter update against a full-weight update, aggregate throughput together vs
one after the other, and each run's share of the generator against its weight (issue 33).

Workload: SmolLM2 on the generator's vLLM engine (the launcher's core split), two LoRA runs created with
``CreateRun`` (rank ``lora_rank`` on every attention and MLP projection, weights 3 and 1; each sent its own random
adapter, B ~ N(0, 0.01), through ``update_weights(..., run_id=)`` before streaming), each streaming ``num_prompts`` chat prompts x ``n_samples_per_prompt`` samples of exactly
``max_new_tokens`` tokens (``ignore_eos``, so every group costs the same), skip_actor_forward and no reference
(generation and scoring: what the runs share). Two sets of services, one after the other:

- *throughput* (no ``max_samples_in_flight``: every group goes at once; each run's request the first
  ``throughput_prompts`` prompts, a trainer's batch that leaves the engine's batch part empty): ``sequential``, run
  a's request then run b's; ``concurrent``, both at once, each read in its own thread as batches arrive.
- *share* (``max_samples_in_flight`` = two groups' samples, so the runs contend for the generator): both at once.

Figures (ratios taken here, in this run; every update through one client, as a trainer keeps one across its steps):
``runs_adapter_vs_full_update_s`` (the median of run a's adapter updates after its first, the trainer's call to the
service's answer once every replica and the forwards have it, against the median of the same calls, after a first
one untimed, with
every tensor of the base model in the dtype a trainer here trains and sends it in (``dtype: auto``: bfloat16 where the
CPU has it natively, float32 where not; the adapter is float32, peft's, sent as the SDK sends it by default: in the
type the deployment serves the policy in, ``ServerInfo.policy_dtype``), sent before the LoRA runs exist; target <=
0.05) and ``runs_adapter_vs_full_update_bytes``; ``runs_adapter_vs_stored_full_update_s`` against the model as stored
(bfloat16 for SmolLM2) whatever the host, the figure before 2026-11-26;
``runs_adapter_qv_vs_full_update_s``, the same for a third run's adapter of that rank on ``q_proj``/``v_proj`` only
(peft's default target modules for Llama models);
``runs_concurrent_vs_sequential_tokens_per_s`` (aggregate sampled tokens
per second; target >= 1.5 where one request leaves the engine's batch half empty), and
``runs_share_vs_weight_a`` = run a's share of the tokens delivered while both runs still had work (until the first
stream ended) / its weight's share 3/4 (target within 1 +- 0.10).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from fastexp import ExperienceClient, RequestOptions, Sampling
from services.common.dtypes import resolve_dtype
from services.common.lora import AdapterConfig, expected_tensors, linear_modules
from services.common.weights import model_spec
from services.demo.datasets import task_problems
from services.experience.runs.limits import DEFAULT_LORA_TARGET_MODULES
from services.launcher import LocalCluster, fresh_state_dir

WEIGHTS = {"a": 3, "b": 1}
#: Full-model updates timed, then run a's adapter updates (each a new adapter, as a trainer's steps send): the
#: figures take each kind's median (one call's time moves with whatever else the host is doing).
FULL_UPDATES = 3
ADAPTER_UPDATES = 5


@dataclass(frozen=True)
class RunsWorkload:
    """Each run's prompts and sampling; the experience service's capacity in groups."""

    task: str = "basic_arithmetic"
    num_prompts: int = 24  # each run's request in the share phase
    throughput_prompts: int = 4  # each run's request in the throughput phase (a trainer's batch of 16 samples)
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 48
    capacity_groups: int = 2
    seed: int = 0
    backend: str = "vllm"
    lora_rank: int = 16


def run(model: str, workload: RunsWorkload, log_dir: Path) -> dict:
    """Measure both runs on ``model`` (a local folder); returns the figures, their inputs and the workload."""
    problems = task_problems(workload.task, workload.num_prompts, seed=workload.seed)
    options = RequestOptions(
        n_samples_per_prompt=workload.n_samples_per_prompt, advantage_estimator="rloo", skip_actor_forward=True,
        kl_coef=0.0, sampling=Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, ignore_eos=True),
    )
    prompts = [list(p.messages) for p in problems]
    batch = prompts[: workload.throughput_prompts]
    # a trainer sends its weights in the dtype it trains in: the one `dtype: auto` picks here, as the services do
    precision = getattr(torch, resolve_dtype("auto", "cpu"))
    config = AdapterConfig(workload.lora_rank, float(workload.lora_rank), DEFAULT_LORA_TARGET_MODULES)
    adapters = {run_id: random_adapter(model, config, seed) for seed, run_id in enumerate(WEIGHTS)}
    # one client for every update, as a trainer keeps one across its steps (its connection and the server's
    # features are set up once, on the first update, not timed into each adapter's)
    with _services(model, workload.backend, log_dir / "runs-throughput", None) as address, \
            ExperienceClient(address) as client:
        stored = load_file(str(Path(model) / "model.safetensors"))
        # a first full update untimed, as run a's first adapter is: the first ones after start ran 1.5-2x slower
        # than the steady state (4.5, 3.3, then 2.3 s here), which a trainer's every step sees
        client.update_weights([(k, v.to(precision)) for k, v in stored.items()])
        full = [_timed_update(client, [(k, v.to(precision)) for k, v in stored.items()]) for _ in range(FULL_UPDATES)]
        stored_s, stored_bytes = _timed_update(client, list(stored.items()))
        _create_runs(client, config, adapters)
        adapter = [_timed_update(client, list(random_adapter(model, config, seed=100 + i).items()), run_id="a")
                   for i in range(ADAPTER_UPDATES)]
        (full_s, full_bytes), (adapter_s, adapter_bytes) = _median(full), _median(adapter)
        qv_s, qv_bytes = _qv_update(client, model, workload.lora_rank)
        started = time.perf_counter()
        for run_id in WEIGHTS:
            _stream(address, run_id, batch, options, [], started)
        sequential_s = time.perf_counter() - started
        concurrent, concurrent_s = _both(address, batch, options)
    capacity = workload.capacity_groups * workload.n_samples_per_prompt
    with _services(model, workload.backend, log_dir / "runs-share", capacity) as address, \
            ExperienceClient(address) as client:
        _create_runs(client, config, adapters)
        contended, _ = _both(address, prompts, options)
    share = _share_while_both(contended, "a")
    tokens = sum(t for _, _, t in concurrent)
    return {
        "runs_adapter_vs_full_update_s": adapter_s / full_s,
        "runs_adapter_vs_full_update_bytes": adapter_bytes / full_bytes,
        "runs_adapter_qv_vs_full_update_s": qv_s / full_s,
        "runs_adapter_vs_stored_full_update_s": adapter_s / stored_s,
        "runs_concurrent_vs_sequential_tokens_per_s": (tokens / concurrent_s) / (tokens / sequential_s),
        "runs_share_vs_weight_a": share / (WEIGHTS["a"] / sum(WEIGHTS.values())),
        "runs_inputs": {"full_update_s": full_s, "full_update_bytes": full_bytes, "full_update_dtype": str(precision),
                        "full_update_s_each": [t for t, _ in full], "adapter_update_s_each": [t for t, _ in adapter],
                        "stored_full_update_s": stored_s, "stored_full_update_bytes": stored_bytes,
                        "adapter_update_s": adapter_s,
                        "adapter_update_bytes": adapter_bytes, "adapter_qv_update_s": qv_s,
                        "adapter_qv_update_bytes": qv_bytes, "sequential_s": sequential_s,
                        "concurrent_s": concurrent_s, "tokens_per_pass": tokens,
                        "share_a_while_both": share, "weights": WEIGHTS},
        "runs_workload": {**asdict(workload), "model": model},
    }


def random_adapter(model: str, config: AdapterConfig, seed: int) -> dict[str, torch.Tensor]:
    """A LoRA adapter with ``config`` over ``model``'s linear layers, peft-named, float32: A ~ N(0, 1/in), B ~
    N(0, 0.01) (a trained adapter's scale: samples stay fluent)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_tensors(config, linear_modules(model_spec(model))).items():
        scale = 0.01 if ".lora_B." in name else shape[1] ** -0.5
        tensors[name] = torch.randn(shape, generator=generator) * scale
    return tensors


def _median(updates: list[tuple[float, int]]) -> tuple[float, int]:
    """The median of timed updates of one kind (their bytes are the same)."""
    return statistics.median(t for t, _ in updates), updates[0][1]


def _timed_update(client: ExperienceClient, tensors: list[tuple[str, torch.Tensor]],
                  run_id: str | None = None) -> tuple[float, int]:
    """One ``update_weights`` call: its wall seconds (the trainer's view) and the bytes it carried."""
    started = time.perf_counter()
    response = client.update_weights(tensors, run_id=run_id)
    return time.perf_counter() - started, response.num_bytes


def _qv_update(client: ExperienceClient, model: str, rank: int) -> tuple[float, int]:
    """A LoRA run "qv" (``rank`` on q_proj and v_proj) sent its first adapter, then timed on its second."""
    config = AdapterConfig(rank, float(rank), ("q_proj", "v_proj"))
    client.create_run("qv", lora_rank=rank, lora_alpha=float(rank), target_modules=list(config.target_modules))
    client.update_weights(list(random_adapter(model, config, seed=10).items()), run_id="qv")
    return _timed_update(client, list(random_adapter(model, config, seed=11).items()), run_id="qv")


def _create_runs(client: ExperienceClient, config: AdapterConfig,
                 adapters: dict[str, dict[str, torch.Tensor]]) -> None:
    """Create runs a and b as LoRA runs (weights 3 and 1) and send each its adapter (version 1)."""
    for run_id, weight in WEIGHTS.items():
        client.create_run(run_id, lora_rank=config.rank, lora_alpha=config.alpha,
                          target_modules=list(config.target_modules), weight=weight)
        client.update_weights(list(adapters[run_id].items()), run_id=run_id)


@contextlib.contextmanager
def _services(model: str, backend: str, log_dir: Path, max_samples_in_flight: int | None) -> Iterator[str]:
    """The three services, warmed up; yields the experience address."""
    capacity = {} if max_samples_in_flight is None else {"max_samples_in_flight": max_samples_in_flight}
    overrides = {"generator": {"model": model, "backend": backend},
                 "experience": {"actor_model": model, "reference_model": model, **capacity}}
    with LocalCluster(overrides=overrides, log_dir=log_dir, state_dir=fresh_state_dir(log_dir / "state")) as cluster:
        address = cluster.address("experience")
        with ExperienceClient(address) as client:
            client.wait_until_ready(900)
            for _ in client.make_experiences([[{"role": "user", "content": "Hi"}]], n_samples_per_prompt=2,
                                             advantage_estimator="rloo", sampling=Sampling(max_new_tokens=8)):
                pass  # warm-up
        yield address


def _both(address: str, prompts, options: RequestOptions) -> tuple[list[tuple[float, str, int]], float]:
    """Both runs' streams at once, each read in its own thread: their batches' arrivals and the wall seconds."""
    arrivals: list[tuple[float, str, int]] = []
    started = time.perf_counter()
    threads = [threading.Thread(target=_stream, args=(address, r, prompts, options, arrivals, started))
               for r in WEIGHTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return arrivals, time.perf_counter() - started


def _stream(address: str, run_id: str, prompts, options: RequestOptions, arrivals: list, started: float) -> None:
    """One run's stream read to the end; each batch's (seconds since ``started``, run, sampled tokens) appended."""
    with ExperienceClient(address) as client:
        for experience in client.make_experiences(prompts, options, run_id=run_id):
            arrivals.append((time.perf_counter() - started, run_id, int(experience.response_length.sum())))


def _share_while_both(arrivals: list[tuple[float, str, int]], run_id: str) -> float:
    """``run_id``'s fraction of the tokens delivered until the first of the streams delivered its last batch."""
    last = {run: max(t for t, r, _ in arrivals if r == run) for run in WEIGHTS}
    cut = min(last.values())
    both = [(r, tokens) for t, r, tokens in arrivals if t <= cut]
    return sum(tokens for r, tokens in both if r == run_id) / sum(tokens for _, tokens in both)


if __name__ == "__main__":
    import json
    import sys

    from services.common.models import SMOLLM2_ALIAS, resolve_model

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench")
    print(json.dumps(run(resolve_model(SMOLLM2_ALIAS), RunsWorkload(), out / "logs"), indent=2))
