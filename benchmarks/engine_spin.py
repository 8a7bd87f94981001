"""vLLM's spin-wait on a CPU host (issue 45, item 3): the same generation with vLLM's own 1 s spin after every
message and with none (:mod:`services.generator.vllm_plugin`), each engine in its own process pinned to the cores
the demo gives the generator, one after the other.

In ``make bench`` (not its small smoke run: two engine starts) and as ``python -m benchmarks.engine_spin [OUT]``:
per setting, the generation's seconds and tokens, the CPU seconds of vLLM's processes (engine core and worker)
during it and during the ``IDLE_S`` seconds after it; the ratios, no spin ÷ spin: tokens per second and CPU seconds
per token. ``python -m benchmarks.engine_spin SPEC OUT`` is one setting (the child process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

IDLE_S = 3.0
PROMPTS = 16
SAMPLES = 4
MAX_NEW_TOKENS = 128


def _vllm_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children: vLLM's engine core and its worker."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def child(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from services.common.models import SMOLLM2_ALIAS, resolve_model
    from services.generator.vllm_engine import engine_options
    from services.generator.vllm_plugin import set_busy_loop

    spec = json.loads(Path(spec_path).read_text())
    set_busy_loop(spec["busy_loop_s"])
    llm = LLM(**engine_options(resolve_model(SMOLLM2_ALIAS), dtype="bfloat16", max_model_len=1024,
                               kv_cache_memory_bytes=1 << 30))
    prompts = [f"Question {i}: count from {i} to {i + 40}, one number per line." for i in range(PROMPTS)] * SAMPLES
    params = SamplingParams(temperature=1.0, max_tokens=MAX_NEW_TOKENS, min_tokens=MAX_NEW_TOKENS, seed=None)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    cpu_before, started = _vllm_cpu_s(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu_generating = time.perf_counter() - started, _vllm_cpu_s() - cpu_before
    cpu_before = _vllm_cpu_s()
    time.sleep(IDLE_S)  # nothing asked of the engine: what does it spend?
    cpu_idle = _vllm_cpu_s() - cpu_before
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    Path(out_path).write_text(json.dumps({"busy_loop_s": spec["busy_loop_s"], "tokens": tokens, "seconds": seconds,
                                          "cpu_s_generating": cpu_generating, "cpu_s_idle": cpu_idle}))


def run(out: Path) -> dict:
    """Both settings, one after the other, with the generator's share of this host as the launcher gives it
    (``VLLM_CPU_OMP_THREADS_BIND``: the worker's threads on the engine cores; the engine core process unpinned, as
    in the demo); returns the figures (``engine_spin_inputs``: each run's own)."""
    from services.launcher import default_core_split

    out.mkdir(parents=True, exist_ok=True)
    split = default_core_split()
    env = {**os.environ, **(split.environment("generator") if split is not None else {})}
    runs = {}
    for busy_loop_s in (1.0, 0.0):  # vLLM's own first, then none
        spec, result = out / f"spin-{busy_loop_s}.spec.json", out / f"spin-{busy_loop_s}.json"
        spec.write_text(json.dumps({"busy_loop_s": busy_loop_s}))
        subprocess.run([sys.executable, "-m", "benchmarks.engine_spin", str(spec), str(result)],
                       check=True, env=env, timeout=1800)  # an engine start and 64 generations: minutes
        runs[busy_loop_s] = json.loads(result.read_text())
    spin, none = runs[1.0], runs[0.0]
    return {
        "engine_spin_inputs": {"runs": list(runs.values()), "generator_environment": env.get("VLLM_CPU_OMP_THREADS_BIND")},
        "engine_no_spin_vs_spin_tokens_per_s": (none["tokens"] / none["seconds"]) / (spin["tokens"] / spin["seconds"]),
        "engine_no_spin_vs_spin_cpu_s_per_token": (none["cpu_s_generating"] / none["tokens"])
        / (spin["cpu_s_generating"] / spin["tokens"]),
        "engine_idle_cpu_s_spin": spin["cpu_s_idle"],
        "engine_idle_cpu_s_no_spin": none["cpu_s_idle"],
    }


if __name__ == "__main__":
    if len(sys.argv) == 3:
        child(*sys.argv[1:])
    else:
        figures = run(Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench/spin"))
        print(json.dumps(figures, indent=2))
