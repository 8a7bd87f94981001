"""Load: N concurrent MakeExperiences streams sharing one generator (``make load``; results in
``out/bench/load.json`` and a printed table; nothing is asserted here).

Each stream is a trainer of its own (a thread with its own channel) asking for ``prompts_per_stream``
reasoning-gym ``gsm_symbolic`` prompts x ``n_samples_per_prompt``. Reported: whether every stream completed with
every group exactly once, samples/s and response tokens/s over the whole run, time to first experience (TTFE)
per stream with its p50/p99 (nearest rank), per-stream completion times, and Jain's fairness index over the
streams' throughputs (1 = perfectly even; 1/N = one stream got everything).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from fastexp import ExperienceClient, Sampling
from services.common.models import resolve_model
from services.demo.datasets import reasoning_gym_problems
from services.launcher import LocalCluster, fresh_state_dir


@dataclass(frozen=True)
class LoadConfig:
    streams: int = 8
    prompts_per_stream: int = 4
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 64
    backend: str = "vllm"
    kv_cache_memory_bytes: int = 1024**3


@dataclass
class StreamResult:
    index: int
    first_s: float | None = None  # since the common start
    last_s: float | None = None
    samples: int = 0
    tokens: int = 0
    prompts_seen: tuple[int, ...] = ()
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of a non-empty list (numpy's ``inverted_cdf``, Hyndman and
    Fan's definition 1)."""
    return float(np.percentile(values, q, method="inverted_cdf"))


def jain_index(values: list[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` (Jain, Chiu & Hawe 1984)."""
    square_sum = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square_sum) if square_sum else 0.0


def run(config: LoadConfig, address: str) -> dict:
    """Run ``config.streams`` streams against the experience service at ``address``; the summary dict."""
    problems = reasoning_gym_problems("gsm_symbolic", config.streams * config.prompts_per_stream, seed=7)
    results = [StreamResult(i) for i in range(config.streams)]
    start_line = threading.Barrier(config.streams + 1)
    started = 0.0

    def trainer(result: StreamResult) -> None:
        mine = problems[result.index * config.prompts_per_stream:(result.index + 1) * config.prompts_per_stream]
        seen: list[int] = []
        with ExperienceClient(address, timeout_s=3600) as client:
            start_line.wait()
            try:
                for experience in client.make_experiences(
                    [list(p.messages) for p in mine], references=[p.reference for p in mine],
                    n_samples_per_prompt=config.n_samples_per_prompt, micro_rollout_batch_size=config.n_samples_per_prompt,
                    sampling=Sampling(max_new_tokens=config.max_new_tokens),
                ):
                    now = time.perf_counter() - started
                    result.first_s = now if result.first_s is None else result.first_s
                    result.last_s = now
                    result.samples += len(experience.reward)
                    result.tokens += int(experience.response_length.sum())
                    seen.extend(experience.prompt_index)
            except Exception as error:  # noqa: BLE001 - reported per stream, the others go on
                result.error = f"{type(error).__name__}: {error}"
        result.prompts_seen = tuple(sorted(seen))

    threads = [threading.Thread(target=trainer, args=(r,), daemon=True) for r in results]
    for thread in threads:
        thread.start()
    start_line.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started

    expected = tuple(sorted(i for i in range(config.prompts_per_stream) for _ in range(config.n_samples_per_prompt)))
    complete = [r.error is None and r.prompts_seen == expected for r in results]
    ttfe = [r.first_s for r in results if r.first_s is not None]
    throughputs = [r.samples / r.last_s for r in results if r.last_s]
    return {
        "config": asdict(config),
        "all_complete": all(complete),
        "streams_complete": sum(complete),
        "wall_s": wall,
        "samples_per_s": sum(r.samples for r in results) / wall,
        "tokens_per_s": sum(r.tokens for r in results) / wall,
        "ttfe_p50_s": percentile(ttfe, 50) if ttfe else None,
        "ttfe_p99_s": percentile(ttfe, 99) if ttfe else None,
        "completion_s": [r.last_s for r in results],
        "jain_fairness": jain_index(throughputs) if throughputs else 0.0,
        "errors": [r.error for r in results if r.error],
    }


def main(
    streams: Annotated[int, typer.Option(min=1, help="concurrent MakeExperiences streams")] = 8,
    prompts_per_stream: Annotated[int, typer.Option(min=1)] = 4,
    n_samples_per_prompt: Annotated[int, typer.Option(min=1)] = 4,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    backend: Annotated[str, typer.Option(help="generator backend: vllm or hf")] = "vllm",
    out: Annotated[Path, typer.Option(help="results folder")] = Path("out/bench"),
) -> None:
    from rich.console import Console
    from rich.table import Table

    config = LoadConfig(streams, prompts_per_stream, n_samples_per_prompt, max_new_tokens, backend)
    model = resolve_model("smollm2-135m-instruct")
    overrides = {
        "generator": {"model": model, "backend": backend, "kv_cache_memory_bytes": config.kv_cache_memory_bytes},
        "experience": {"actor_model": model, "reference_model": model, "torch_threads": 1},
    }
    with LocalCluster(overrides=overrides, log_dir=out / "logs" / "load",
                      state_dir=fresh_state_dir(out / "logs" / "load-state")) as cluster:
        summary = run(config, cluster.address("experience"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = Table(title=f"{streams} concurrent streams, {backend}, SmolLM2-135M")
    table.add_column("figure")
    table.add_column("value")
    for key in ("all_complete", "streams_complete", "wall_s", "samples_per_s", "tokens_per_s", "ttfe_p50_s",
                "ttfe_p99_s", "jain_fairness"):
        value = summary[key]
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)
    if not summary["all_complete"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
