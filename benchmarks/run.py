"""``make bench``: run every benchmark, print a table with the machine, write ``out/bench/results.json``.

Every figure is a ratio of two timings taken in the same run on the same inputs (see each module's docstring);
targets are printed next to them, never asserted. ``--small`` runs tiny sizes as a smoke test of the benchmark
code (CI runs it through the test suite); its figures are not measurements.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from benchmarks import (
    adapter_memory,
    core_share,
    engine_spin,
    episodes,
    fleet,
    gae,
    judge,
    packing,
    pipeline,
    replicas,
    resume,
    runs,
    state,
    stream_overhead,
    trl_experience,
    trl_step,
)
from services.common.dtypes import native_bfloat16
from services.common.models import SMOLLM2_ALIAS, resolve_model

#: The issue's targets; a figure without one is informative (a seed's claim, or a precision).
TARGETS = {
    "generator_service_vs_inprocess_vllm": ">= 0.95",
    "first_batch_vs_last": "<= 0.25",
    "experience_overhead_vs_generation": "<= 0.3",
    "stream_vs_raw_bytes": ">= 0.5",
    "vllm_vs_hf": "2-5 (the seed's guide)",
    "packed_vs_padded": "< 1",
    "span_attention_vs_mask": "< 1 (issue 45: forwards at the hardware's speed)",
    "gae_vectorized_speedup": ">= 10",
    "gae_max_abs_error": "<= 1e-5",
    "stream_vs_generation": "<= 1.3",
    "fleet_two_vs_one_replica": ">= 1.8",
    "episodes_async_vs_turn_synchronous": ">= 1.5",
    "trl_fastexp_step_vs_trl_alone": "<= 1.0 (a GRPO step through fastexp, a LoRA run on vLLM, vs TRL alone)",
    "judge_batched_vs_per_response": ">= 3",
    "judge_cache_hit_rate": "informative (items answered from the cache)",
    "judge_cache_calls_saved": "informative (judge prompts not sent)",
    "runs_adapter_vs_full_update_s": "<= 0.05 (the full update: the model in the dtype `dtype: auto` picks here)",
    "engine_no_spin_vs_spin_tokens_per_s": "informative (a lone engine on an idle host: spinning takes a 2nd core)",
    "core_share_stream_vs_fixed_split_tokens_per_s": "> 1 (the engine lent every core while no forward waits)",
    "core_share_stream_skip_actor_vs_fixed_split_tokens_per_s": "> 1",
    "core_share_generation_vs_fixed_split_tokens_per_s": "> 1 (generation alone on every core, not half)",
    "core_share_first_batch_vs_fixed_split_s": "informative (< 1: sooner)",
    "first_batch_vs_generation": "informative (the stream's first batch / generation alone)",
    "stream_vs_compute_floor": ">= 0.9 (generation and both forwards alone, each on every core, / the stream)",
    "stream_skip_actor_vs_compute_floor": ">= 0.9 (generation and the reference's forward alone / the stream)",
    "fastexp_vs_trl_tokens_per_s_full": ">= 1.5 (TRL: vLLM colocate, old and reference log-probs)",
    "fastexp_vs_trl_tokens_per_s_reference": ">= 1.5 (TRL without its importance-sampling correction)",
    "engine_no_spin_vs_spin_cpu_s_per_token": "< 1 (the CPU the spin took, given back to the forwards)",
    "runs_adapter_vs_full_update_bytes": "informative (an adapter's bytes / the base model's)",
    "runs_adapter_qv_vs_full_update_s": "<= 0.05 (rank 16 on q_proj/v_proj, peft's default for Llama)",
    "runs_adapter_vs_stored_full_update_s": "informative (the full update with the model as stored, bf16: the figure before 2026-11-26)",
    "runs_concurrent_vs_sequential_tokens_per_s": ">= 1.5",
    "runs_share_vs_weight_a": "1 ± 0.10",
    "adapter_memory_rss_vs_tensor_bytes": "informative (resident memory per LoRA adapter / its tensor bytes)",
    "state_store_vs_stream_s_sqlite": "<= 0.03",
    "state_store_vs_stream_s_postgresql": "<= 0.03",
    "state_store_vs_update_s_sqlite": "informative (store calls and the version's blob / the update)",
    "state_store_vs_update_s_postgresql": "informative (store calls and the version's blob / the update)",
    "catch_up_vs_update_s_sqlite": "informative (a second replica loading the version / the update)",
    "catch_up_vs_update_s_postgresql": "informative (a second replica loading the version / the update)",
    "adapter_catch_up_vs_update_s_sqlite": "informative (a second replica loading a LoRA run's adapter / its update)",
    "adapter_catch_up_vs_update_s_postgresql": "informative (a second replica loading a LoRA run's adapter / its update)",
    "resume_next_row_excess_s": "<= 5 (SIGKILL to the next row, less one group's own time)",
    "resume_regenerated_vs_undelivered": "<= 1 (only what was not delivered is generated again)",
    "resume_total_vs_uninterrupted_s": "informative (a stream that lost its replica / one that did not)",
    "replicas_two_vs_one_rows_per_s": "informative (2 cores: the engine and one replica fill them; see README)",
    "replica_rss_gib": "informative (resident memory of each experience replica added)",
    "replica_store_calls_per_stream": "informative (state-store calls one stream costs a replica)",
}
SMALL_WORKLOAD = pipeline.Workload(
    num_prompts=4, n_samples_per_prompt=2, max_new_tokens=16, max_num_seqs=4, kv_cache_memory_bytes=256 * 1024**2,
    max_model_len=512, stream_replays=2,
)
SMALL_DEMO_WORKLOAD = stream_overhead.DemoWorkload(num_prompts=2, n_samples_per_prompt=2, max_new_tokens=8)
SMALL_FLEET_WORKLOAD = fleet.FleetWorkload(num_prompts=4, n_samples_per_prompt=2, max_new_tokens=8, backend="hf")
SMALL_EPISODE_WORKLOAD = episodes.EpisodeWorkload(
    num_prompts=2, n_samples_per_prompt=2, max_turns=2, max_new_tokens=16, backend="hf"
)
SMALL_RUNS_WORKLOAD = runs.RunsWorkload(num_prompts=2, throughput_prompts=2, n_samples_per_prompt=2, max_new_tokens=4,
                                       backend="hf")
SMALL_STATE_WORKLOAD = state.StateWorkload(num_prompts=2, n_samples_per_prompt=2, max_new_tokens=4,
                                           micro_rollout_batch_size=2, backend="hf")
SMALL_RESUME_WORKLOAD = resume.ResumeWorkload(num_prompts=6, n_samples_per_prompt=2, max_new_tokens=4,
                                             kill_after_batches=1, backend="hf")
SMALL_REPLICAS_WORKLOAD = replicas.ReplicasWorkload(num_prompts=2, n_samples_per_prompt=2, prompt_words=20,
                                                   max_new_tokens=4, backend="hf")
SMALL_JUDGE_WORKLOAD = judge.JudgeWorkload(
    num_prompts=2, n_samples_per_prompt=2, judge_max_new_tokens=2, policy_max_new_tokens=2, refill_rounds=2
)


def main(
    out: Annotated[Path, typer.Option(help="results folder")] = Path("out/bench"),
    small: Annotated[bool, typer.Option(help="tiny sizes: a smoke test, not a measurement")] = False,
    services: Annotated[bool, typer.Option(help="run the service benchmarks (vLLM, HF, gRPC): ratios 1-5, 7-9")] = True,
) -> None:
    results = measure(out, small=small, services=services)
    Console().print(_table(results))


def measure(out: Path, *, small: bool = False, services: bool = True) -> dict:
    """Run the benchmarks and write ``out/results.json`` and ``out/results.md``; returns the results."""
    model = resolve_model(SMOLLM2_ALIAS)
    results: dict[str, object] = {"machine": machine(model), "small": small}
    if services:
        results.update(pipeline.run(model, SMALL_WORKLOAD if small else pipeline.Workload(), out / "logs"))
        demo = SMALL_DEMO_WORKLOAD if small else stream_overhead.DemoWorkload()
        results.update(stream_overhead.run(model, demo, out / "logs", compiled=not small))
        results.update(fleet.run(model, SMALL_FLEET_WORKLOAD if small else fleet.FleetWorkload(), out / "logs"))
        episode_workload = SMALL_EPISODE_WORKLOAD if small else episodes.EpisodeWorkload()
        results.update(episodes.run(model, episode_workload, out / "logs"))
        results.update(judge.run(model, SMALL_JUDGE_WORKLOAD if small else judge.JudgeWorkload()))
        results.update(runs.run(model, SMALL_RUNS_WORKLOAD if small else runs.RunsWorkload(), out / "logs"))
        results.update(state.run(model, SMALL_STATE_WORKLOAD if small else state.StateWorkload(), out / "logs"))
        results.update(resume.run(model, SMALL_RESUME_WORKLOAD if small else resume.ResumeWorkload(), out / "logs"))
        workload = SMALL_REPLICAS_WORKLOAD if small else replicas.ReplicasWorkload()
        results.update(replicas.run(model, workload, out / "logs"))
        if not small:  # two trainers and the services: minutes even at tiny sizes (tests/integration/test_trl.py
            # covers the integration itself)
            results.update(trl_step.run(model, trl_step.TrlStepWorkload(), out / "logs"))
            results.update(engine_spin.run(out / "spin"))  # two engine starts, nothing else to smoke-test
            results.update(core_share.run(model, demo, out / "logs", shared=results))  # the fixed split's runs
            results.update(trl_experience.run(model, demo, out / "logs", fastexp=results))  # TRL's, same prompts
    results.update(
        packing.run(model, rows=4, max_response=16, micro_batch_size=2, repeats=1) if small else packing.run(model)
    )
    results.update(gae.run(batch=8, length=256, repeats=1) if small else gae.run())
    results.update(adapter_memory.run(model, counts=(1, 2), rank=4) if small else adapter_memory.run(model))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(_markdown(results))
    return results


def _cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def machine(model: str) -> dict:
    """Where the figures were taken: cores, CPU, accelerator, torch, the model and the generator backend."""
    return {
        "cores": os.cpu_count(), "cpu": _cpu_model() or platform.processor() or platform.machine(),
        "native_bfloat16": native_bfloat16("cpu"), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model": Path(model).name, "backend": "vllm (services), hf (baseline of vllm_vs_hf)",
    }


def _figures(results: dict) -> list[tuple[str, str, str]]:
    rows = []
    for key, value in results.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        rows.append((key, f"{value:.4g}" if isinstance(value, float) else str(value), TARGETS.get(key, "")))
    return rows


def _table(results: dict) -> Table:
    table = Table(title=f"fastexp benchmarks ({'smoke' if results['small'] else 'full'})\n{results['machine']}")
    for column in ("figure", "value", "target"):
        table.add_column(column)
    for row in _figures(results):
        table.add_row(*row)
    return table


def _markdown(results: dict) -> str:
    lines = [f"machine: {results['machine']}", "", "| figure | value | target |", "|---|---|---|"]
    lines += [f"| {key} | {value} | {target} |" for key, value, target in _figures(results)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    typer.run(main)
