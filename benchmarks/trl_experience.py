"""fastexp's experience stream against TRL's own experience making, per token, on the same prompts (issue 45).

TRL side, in a process of its own: TRL 1.16.0's ``GRPOTrainer`` with vLLM in colocate mode (the engine in the
trainer's process, on every core), the model (trainer and vLLM alike: TRL's ``LLM`` is given the dtype, which TRL
itself does not pass, see :func:`child`) in the dtype fastexp's ``dtype: auto`` picks
on this CPU (bf16 where it multiplies bf16 natively, float32 where it does not: :mod:`services.common.dtypes`),
``beta`` 0.04 (a reference model), on the demo's prompts (16
``gsm_symbolic`` chat prompts x 4 samples, temperature 1, up to 256 tokens); one call of its experience making
(``_generate_and_score_completions``: generation, rewards, log-probs) is timed after a warm-up call of one prompt:

- ``full``: TRL's default with vLLM, ``vllm_importance_sampling_correction`` on: generation, the policy's log-probs
  (old) and the reference's;
- ``reference``: the correction off: generation and the reference's log-probs.

fastexp side: :mod:`benchmarks.stream_overhead`'s ``stream`` (actor and reference forwards) and
``stream_skip_actor`` (reference only) from the same invocation, on the same prompts and sizes.

Figures (fastexp's tokens per second / TRL's, each path against its match; target >= 1.5):
``fastexp_vs_trl_tokens_per_s_full``, ``fastexp_vs_trl_tokens_per_s_reference``; ``trl_experience_inputs`` has
TRL's times (the call's, and its generation's within it) and tokens. The two sample different tokens (different samplers and seeds), hence per token.
Alone: ``python -m benchmarks.trl_experience [out]`` (runs stream_overhead too, and writes its figures with these);
``python -m benchmarks.trl_experience OUT --fastexp RESULTS`` runs TRL's side again against the stream figures in an
earlier run's ``results.json``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks import stream_overhead


def run(model: str, workload: stream_overhead.DemoWorkload, log_dir: Path, fastexp: dict | None = None) -> dict:
    """TRL's two paths in a child process, against ``fastexp`` (``stream_overhead.run``'s result from the same
    invocation; measured here when None); returns the figures."""
    if fastexp is None:
        fastexp = stream_overhead.run(model, workload, log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    spec, result = log_dir / "trl_experience.spec.json", log_dir / "trl_experience.json"
    spec.write_text(json.dumps({"model": model, "workload": asdict(workload)}))
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
    with (log_dir / "trl_experience.log").open("w") as log:
        subprocess.run([sys.executable, "-m", "benchmarks.trl_experience", "--child", str(spec), str(result)],
                       check=True, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    trl = json.loads(result.read_text())
    ours = fastexp["stream_overhead_inputs"]
    return {
        "fastexp_vs_trl_tokens_per_s_full": ours["stream"]["tokens_per_s"] / trl["full"]["tokens_per_s"],
        "fastexp_vs_trl_tokens_per_s_reference": ours["stream_skip_actor"]["tokens_per_s"]
        / trl["reference"]["tokens_per_s"],
        "trl_experience_inputs": {**trl, "fastexp": {run: ours[run] for run in ("generation", "stream", "stream_skip_actor")}},
    }


def child(spec_path: str, out_path: str) -> None:
    """TRL's experience making, both paths (module docs); writes their times and tokens to ``out_path``."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation

    from services.common.dtypes import resolve_dtype
    from services.demo.datasets import task_problems
    from services.scorer.rules import math_verify_reward

    spec = json.loads(Path(spec_path).read_text())
    workload = stream_overhead.DemoWorkload(**spec["workload"])
    problems = task_problems(workload.task, workload.num_prompts, seed=workload.seed)
    rows = [{"prompt": list(p.messages), "answer": p.reference} for p in problems]

    def reward(prompts, completions, answer, **kwargs) -> list[float]:
        return [math_verify_reward(c[0]["content"], a)[0] for c, a in zip(completions, answer, strict=True)]

    n = workload.n_samples_per_prompt
    dtype = resolve_dtype("auto", "cpu")  # what a TRL user picks on this CPU too: emulated bf16 is slower than float32
    args = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl_experience_trainer"), use_vllm=True, vllm_mode="colocate",
        per_device_train_batch_size=len(rows) * n, num_generations=n, max_completion_length=workload.max_new_tokens,
        temperature=1.0, beta=0.04, bf16=dtype == "bfloat16", use_cpu=True, report_to=[], save_strategy="no", seed=workload.seed,
        vllm_max_model_length=1024, disable_tqdm=True,
    )
    # the trainer and TRL's vLLM load a copy saved in ``dtype``; the engine's dtype itself comes from the patch below
    # (vLLM's auto would take a float32 copy down to bf16)
    folder = Path(out_path).parent / f"trl_experience_model_{dtype}"
    AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, dtype)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(spec["model"]).save_pretrained(folder)  # vLLM reads it from the same folder
    # TRL 1.16 builds its colocated vLLM without a dtype, and vLLM's "auto" downcasts a float32 checkpoint to bf16
    # ("Downcasting torch.float32 to torch.bfloat16" in its log): without native bf16 that decodes 3.7x slower than
    # float32 (50 against 187 tokens/s on 32 prompts x 128 tokens, 2026-11-26). Given the trainer's dtype here, so
    # that both sides generate in the same arithmetic; TRL offers no setting for it
    vllm_generation.LLM = functools.partial(vllm_generation.LLM, dtype=dtype)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)), reward_funcs=[reward],
        processing_class=AutoTokenizer.from_pretrained(spec["model"]), args=args,
        train_dataset=datasets.Dataset.from_list(rows),
    )
    trainer.model.eval()
    # vLLM already holds these weights (loaded from the same folder): TRL's first-step sync would push them again,
    # which its colocated loader cannot do on vLLM's CPU build (its repacked layers drop their weight loaders)
    trainer._last_loaded_step = trainer.state.global_step
    inputs = [row for row in rows for _ in range(n)]  # each prompt n times in a row, as TRL's sampler gives them
    generating = _timed(trainer, "_generate")  # TRL's generation inside each call
    trainer._generate_and_score_completions(inputs[:n])  # warm-up: one prompt's group
    paths = {}
    for name, correction in (("full", True), ("reference", False)):
        trainer.vllm_importance_sampling_correction = correction
        generating.clear()
        started = time.perf_counter()
        out = trainer._generate_and_score_completions(inputs)
        seconds = time.perf_counter() - started
        tokens = int(out["completion_mask"].sum())
        paths[name] = {"seconds": seconds, "generation_s": sum(generating), "tokens": tokens,
                       "tokens_per_s": tokens / seconds, "old_log_probs": out.get("old_per_token_logps") is not None}
    Path(out_path).write_text(json.dumps({**paths, "torch_threads": torch.get_num_threads(), "dtype": dtype,
                                          "engine_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
                                          if hasattr(trainer, "vllm_generation") else None}, indent=2))


def _timed(owner, name: str) -> list[float]:
    """Wrap ``owner.name`` so that each call's seconds are appended to the returned list."""
    seconds: list[float] = []
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    setattr(owner, name, timed)
    return seconds


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
    else:
        from services.common.models import SMOLLM2_ALIAS, resolve_model

        out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench/trl_experience")
        model, workload = resolve_model(SMOLLM2_ALIAS), stream_overhead.DemoWorkload()
        if len(sys.argv) > 3 and sys.argv[2] == "--fastexp":  # TRL again against an earlier run's stream figures
            ours = {k: v for k, v in json.loads(Path(sys.argv[3]).read_text()).items() if not k.startswith("fastexp_vs")}
        else:
            ours = stream_overhead.run(model, workload, out / "logs")  # its figures too (the compute floor among them)
        figures = {**ours, **run(model, workload, out / "logs", fastexp=ours)}
        (out / "results.json").write_text(json.dumps(figures, indent=2) + "\n")
        print(json.dumps(figures, indent=2))
