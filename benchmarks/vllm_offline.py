"""In-process vLLM baseline: ``vllm.LLM.generate`` on the generator's own engine arguments, in its own process.

Run by :mod:`benchmarks.pipeline` as ``python -m benchmarks.vllm_offline SPEC OUT``; SPEC is a JSON file with the
model, the engine options (:func:`services.generator.vllm_engine.engine_options`), the prompts' token ids and the
sampling; OUT receives ``{"tokens", "seconds", "tokens_per_s"}``. A separate process so that its engine is gone
before the generator service starts its own (and its engine-core process is spawned from a ``__main__`` guard).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from services.generator.vllm_engine import engine_options

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(**engine_options(spec["model"], **spec["engine"]))
    sampling = spec["sampling"]
    # one request per sample, as the generator sends them (n=1, sample j seeded with seed + j when seeded)
    prompts, params = [], []
    for ids in spec["prompt_token_ids"]:
        for sample in range(spec["n_samples_per_prompt"]):
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            seed = sampling.get("seed")
            params.append(SamplingParams(
                n=1, temperature=sampling["temperature"], max_tokens=sampling["max_new_tokens"],
                min_tokens=sampling["min_new_tokens"], seed=None if seed is None else seed + sample, logprobs=0,
            ))
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, as the service gets one
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    Path(out_path).write_text(json.dumps({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}))


if __name__ == "__main__":
    main(*sys.argv[1:])
