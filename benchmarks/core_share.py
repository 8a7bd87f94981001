"""The host's cores moved to the work against a fixed split (issue 45, item 1), on the demo's workload.

Both runs are :mod:`benchmarks.stream_overhead`'s four (generation alone, the stream with both forwards, without
the actor's, without either), seeded alike; they do not sample quite the same tokens (bf16 sums differ with the
engine's thread count, and a sampled token with them), so the figures compare tokens per second:

- ``shared`` (the launcher's default, :meth:`services.launcher.CoreSplit.for_host`): the engine is bound to every
  core and runs on all of them while no forward pass waits, on half while one does
  (:mod:`services.experience.fleet.cores`); a forward pass takes every core while no generation is in flight.
- ``fixed`` (what the launcher gave before): the engine bound to half the cores for good; the forwards as above.

Figures, each shared / fixed from the same invocation: ``core_share_stream_vs_fixed_split_tokens_per_s`` (the
demo's stream; > 1: faster), ``core_share_stream_skip_actor_vs_fixed_split_tokens_per_s`` (reference forward
only), ``core_share_generation_vs_fixed_split_tokens_per_s`` (generation alone),
``core_share_first_batch_vs_fixed_split_s`` (< 1: sooner); ``core_share_inputs`` has both runs. ``make bench`` takes the shared run from its own ``stream_overhead`` figures.
Alone: ``python -m benchmarks.core_share [out]``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks import stream_overhead
from services.launcher import CoreSplit


def fixed_split(cores: int) -> CoreSplit:
    """The default split without lending the engine the forwards' cores."""
    default = CoreSplit.for_host(cores)
    return CoreSplit(default.engine_cores, default.forward_threads, idle_forward_threads=default.idle_forward_threads)


def run(model: str, workload: stream_overhead.DemoWorkload, log_dir: Path, shared: dict | None = None,
        cores: int | None = None) -> dict:
    """The fixed split's runs, and the shared split's unless ``shared`` (``stream_overhead.run``'s result from
    the same invocation) is given; returns the figures."""
    if shared is None:
        shared = stream_overhead.run(model, workload, log_dir)
    fixed = stream_overhead.run(model, workload, log_dir, core_split=fixed_split(cores or os.cpu_count() or 1),
                                name="core_share_fixed")
    runs = {"shared": shared["stream_overhead_inputs"], "fixed": fixed["stream_overhead_inputs"]}

    def speedup(run: str) -> float:  # per token: the runs' samples differ (thread counts change the numerics)
        return runs["shared"][run]["tokens_per_s"] / runs["fixed"][run]["tokens_per_s"]

    return {
        "core_share_stream_vs_fixed_split_tokens_per_s": speedup("stream"),
        "core_share_stream_skip_actor_vs_fixed_split_tokens_per_s": speedup("stream_skip_actor"),
        "core_share_generation_vs_fixed_split_tokens_per_s": speedup("generation"),
        "core_share_first_batch_vs_fixed_split_s": runs["shared"]["stream"]["first_batch_s"]
        / runs["fixed"]["stream"]["first_batch_s"],
        "core_share_inputs": runs,
    }


if __name__ == "__main__":
    from services.common.models import SMOLLM2_ALIAS, resolve_model

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench/core_share")
    figures = run(resolve_model(SMOLLM2_ALIAS), stream_overhead.DemoWorkload(), out / "logs")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
