"""Scenarios on :class:`services.generator.vllm_inline.InlineLLM` over a real vLLM engine, in a process of their own.

``python -m tests.support.inline_engine MODEL OUT`` builds the engine on MODEL, runs each scenario in order and
writes what it observed to OUT (JSON); the test asserts on it. A process apart because vLLM in process replaces
``torch.set_num_threads`` and sets process-wide variables that the test process's other services must not see.
Waits are on conditions read from the engine's own thread (how many requests it runs, how many it holds), never
on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch

#: How long a condition may take to hold before the scenario fails (seconds; a loaded CI machine is slow).
WAIT_S = 120.0


async def _until(llm: Any, probe: Any, expected: Any) -> Any:
    """Ask the engine's thread ``probe(engine)`` until it answers ``expected`` (between steps); its last answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while (answer := await llm._call(probe)) != expected and loop.time() < deadline:
        await asyncio.sleep(0.01)  # polling the condition, not waiting for time to pass
    return answer


async def _tokens(llm: Any, prompt: Any, params: Any, request_id: str, lora: Any = None) -> int:
    final = None
    async for output in llm.generate(prompt, params, request_id=request_id, lora_request=lora):
        final = output
    return len(final.outputs[0].token_ids)


async def _outputs(llm: Any, prompt: Any, params: Any, request_id: str) -> int:
    """How many outputs the stream gave before it ended (0: aborted)."""
    return len([output async for output in llm.generate(prompt, params, request_id=request_id)])


async def _versions(llm: Any, model: str) -> dict[str, Any]:
    """Through :class:`~services.generator.vllm_engine.VLLMEngine` on this engine: a request running when a weight
    update starts (it finishes on the old weights), and one whose samples reach the engine only after the update's
    pause began (asyncio runs tasks in the order they were made: the request's sample tasks after the update's), so
    the pause holds them and they run on the new weights. The update reloads the model's own checkpoint. Also
    counted: how many requests the pause held (so the scenario did race).
    """
    from fastexp.sampling import SamplingOptions
    from services.common.generation import GenerationRequest
    from services.generator.engine import ModelDescription
    from services.generator.vllm_engine import VLLMEngine

    tokenizer = llm.get_tokenizer()
    engine = VLLMEngine(llm, ModelDescription(model, model, 1024, "vllm", tokenizer.eos_token_id,
                                              tokenizer.eos_token_id), tokenizer, {})

    def request(request_id: str, max_new_tokens: int, n: int) -> GenerationRequest:
        sampling = SamplingOptions(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True, seed=3)
        return GenerationRequest(request_id, ((1, 2, 3, 4, 5),), sampling, n)

    async def versions(records: Any) -> list[int]:
        return [record.policy_version async for record in records]

    held_at_resume: list[int] = []
    resume = llm._resume

    def counted_resume(e: Any) -> None:  # on the engine's thread: how many adds the pause held
        held_at_resume.append(sum(r.add is not None for r in llm._requests.values()))
        resume(e)

    llm._resume = counted_resume
    running = asyncio.create_task(versions(engine.generate(request("running", 48, 1))))
    await _until(llm, lambda e: e.get_num_unfinished_requests(), 1)
    held = engine.generate(request("held", 6, 3))
    first = asyncio.create_task(anext(held))  # runs first: reads the version, makes the sample tasks
    # the body update_weights shields (the shield's own task would start after the sample tasks): its pause is
    # posted in this task's first step, before the sample tasks add their requests
    update = asyncio.create_task(engine._update_weights("checkpoint", model, None))
    async with asyncio.timeout(WAIT_S):
        held_versions = [(await first).policy_version] + await versions(held)
        return {"version_running": await running, "version_held": held_versions, "version_updated": await update,
                "version_after": await versions(engine.generate(request("after", 4, 1))),
                "version_held_at_resume": held_at_resume}


async def _adapters(llm: Any, model: str) -> dict[str, Any]:
    """Through :class:`~services.generator.vllm_engine.VLLMEngine` on this engine (one adapter slot, one built adapter
    kept by vLLM): adapter a (scaling 1) and b (scaling 2, which vLLM folds into lora_B in place) loaded in process,
    so the worker is handed their tensors as they are; loading b evicts a, sampling a rebuilds it (evicting b), then
    b is rebuilt. Observed, for a and b: whether the worker keeps the very tensors loaded (no copy), whether they
    still hold what was sent after the builds and rebuilds, whether the rebuilt adapter samples what it sampled
    first (greedy tokens and log-probs), and whether the adapter changes the base's log-probs at all.
    """
    from fastexp.sampling import SamplingOptions
    from services.common.generation import GenerationRequest
    from services.common.lora import AdapterConfig, expected_tensors, linear_modules
    from services.common.weights import model_spec
    from services.generator.engine import ModelDescription
    from services.generator.vllm_engine import VLLMEngine

    tokenizer = llm.get_tokenizer()
    engine = VLLMEngine(llm, ModelDescription(model, model, 1024, "vllm", tokenizer.eos_token_id,
                                              tokenizer.eos_token_id), tokenizer, linear_modules(model_spec(model)))
    configs = {"a": AdapterConfig(8, 8.0, ("q_proj", "v_proj")), "b": AdapterConfig(8, 16.0, ("q_proj", "v_proj"))}
    generator = torch.Generator().manual_seed(5)
    loaded = {name: {k: torch.randn(shape, generator=generator) for k, shape in
                     expected_tensors(config, engine.lora_modules).items()} for name, config in configs.items()}
    sent = {name: {k: t.clone() for k, t in tensors.items()} for name, tensors in loaded.items()}

    async def greedy(adapter: str | None) -> tuple[list[int], Any]:
        sampling = SamplingOptions(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        records = [r async for r in engine.generate(GenerationRequest(f"greedy-{adapter}", ((1, 2, 3, 4, 5),),
                                                                      sampling, 1), adapter=adapter)]
        return list(records[0].output_token_ids), torch.from_numpy(records[0].output_log_probs)

    base = await greedy(None)
    await engine.load_adapter("a", configs["a"], loaded["a"])
    first = {"a": await greedy("a")}
    await engine.load_adapter("b", configs["b"], loaded["b"])  # evicts a's build
    first["b"] = await greedy("b")
    again = {"a": await greedy("a")}  # rebuilt from the kept tensors, evicting b
    again["b"] = await greedy("b")  # rebuilt: a scaling folded into its kept tensors would show here
    kept = [tensors for _, tensors in (await llm.collective_rpc(lambda w: w._fastexp_adapters))[0].values()]

    def uncopied(name: str) -> bool:  # a kept load holds the very memory of the tensors loaded
        return any(t.keys() == loaded[name].keys() and all(t[k].data_ptr() == loaded[name][k].data_ptr() for k in t)
                   for t in kept)

    return {
        "adapter_kept_uncopied": [uncopied(name) for name in configs],
        "adapter_kept_as_sent": [all(torch.equal(loaded[n][k], sent[n][k]) for k in sent[n]) for n in configs],
        "adapter_rebuilt_alike": [first[n][0] == again[n][0] and torch.equal(first[n][1], again[n][1])
                                  for n in configs],
        "adapter_changes_log_probs": [bool((first[n][1] - base[1]).abs().max() > 1e-3) or first[n][0] != base[0]
                                      for n in configs],
    }


async def scenarios(llm: Any, model: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from services.generator.vllm_lora import lora_request

    def params(max_tokens: int, **extra: Any) -> Any:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY,
                              **extra)

    prompt = TokensPrompt(prompt_token_ids=[1, 2, 3, 4, 5])
    running = lambda engine: engine.get_num_unfinished_requests()  # noqa: E731
    held_count = lambda engine: sum(r.add is not None for r in llm._requests.values())  # noqa: E731
    seen: dict[str, Any] = {}

    def step(name: str) -> None:
        print(f"scenario: {name}", file=sys.stderr, flush=True)  # where a failed run stopped

    step("concurrent")

    # many requests at once, each to its own end
    seen["concurrent_tokens"] = await asyncio.gather(*(_tokens(llm, prompt, params(8 + i), f"c{i}") for i in range(8)))

    step("two calls with one id are two requests")
    seen["twin_tokens"] = await asyncio.gather(_tokens(llm, prompt, params(5), "twin"),
                                               _tokens(llm, prompt, params(9), "twin"))

    step("a consumer that gives up aborts its request")
    task = asyncio.create_task(_tokens(llm, prompt, params(1000), "given-up"))
    seen["given_up_running"] = await _until(llm, running, 1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    seen["given_up_after_cancel"] = await llm._call(running)  # the abort was queued before this question

    step("a pause waits for what runs, holds what comes, and adds it at resume")
    first = asyncio.create_task(_tokens(llm, prompt, params(48), "before-pause"))
    await _until(llm, running, 1)
    await llm.pause_generation(mode="wait", clear_cache=True)
    seen["pause_returned_after_running_request"] = first.done() and first.result() == 48
    held = asyncio.create_task(_tokens(llm, prompt, params(12), "while-paused"))
    seen["held_while_paused"] = await _until(llm, held_count, 1)
    seen["running_while_paused"] = await llm._call(running)
    await llm.resume_generation()
    async with asyncio.timeout(WAIT_S):
        seen["held_tokens_after_resume"] = await held

    step("a held request aborted ends its stream; one vLLM rejects at resume fails alone")
    await llm.pause_generation(mode="wait", clear_cache=True)
    aborted = asyncio.create_task(_outputs(llm, prompt, params(6), "held-aborted"))
    rejected = asyncio.create_task(_tokens(llm, TokensPrompt(prompt_token_ids=[10**7]), params(6), "held-rejected"))
    kept = asyncio.create_task(_tokens(llm, prompt, params(6), "held-kept"))
    await _until(llm, held_count, 3)
    await llm.abort("held-aborted")
    await llm.resume_generation()
    async with asyncio.timeout(WAIT_S):
        results = await asyncio.gather(aborted, rejected, kept, return_exceptions=True)
    seen["held_outcomes"] = [r if isinstance(r, int) else type(r).__name__ for r in results]

    step("a pause whose caller is cancelled leaves the engine alive")
    long = asyncio.create_task(_outputs(llm, prompt, params(1000), "long"))
    await _until(llm, running, 1)
    pausing = asyncio.create_task(llm.pause_generation(mode="wait", clear_cache=True))
    await _until(llm, lambda engine: llm._paused, True)
    pausing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pausing
    await llm.abort("long")
    await llm.resume_generation()
    seen["after_cancelled_pause"] = [await long, await _outputs(llm, prompt, params(6), "after"), llm.errored]

    step("worker calls run on the engine's thread, between steps: the model's threads set and read back")
    seen["rpc_on_engine_thread"] = await llm.collective_rpc(lambda worker: threading.get_ident()) == [
        llm._thread.ident]
    seen["threads_setup"] = await llm.collective_rpc("fastexp_setup_cpu")
    seen["threads_set_1"] = await llm.collective_rpc("fastexp_cpu_threads", args=(1,))
    seen["threads_read"] = await llm.collective_rpc("fastexp_cpu_threads")

    step("a request held by a weight update's pause carries the version of the weights it ran on")
    seen.update(await _versions(llm, model))

    step("adapters loaded in process: kept as they are, rebuilt alike after an eviction")
    seen.update(await _adapters(llm, model))

    # an adapter load that no worker keeps fails inside the step that schedules it (the worker builds it there):
    # running streams, new requests and health all report EngineDeadError
    step("a step that raises kills the engine")
    victim = asyncio.create_task(_tokens(llm, prompt, params(1000), "victim"))
    await _until(llm, running, 1)
    killer = asyncio.create_task(_tokens(llm, prompt, params(4), "killer", lora_request("ghost", 7)))
    outcomes = await asyncio.gather(victim, killer, return_exceptions=True)
    seen["streams_after_death"] = [type(outcome).__name__ for outcome in outcomes]
    seen["errored"] = llm.errored
    try:
        await llm.check_health()
        seen["health_after_death"] = "healthy"
    except Exception as error:
        seen["health_after_death"] = type(error).__name__
    try:
        await _tokens(llm, prompt, params(4), "after-death")
        seen["request_after_death"] = "served"
    except Exception as error:
        seen["request_after_death"] = type(error).__name__
    return seen


def main(model: str, out: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from services.generator.vllm_engine import engine_options
    from services.generator.vllm_inline import InlineLLM

    llm = InlineLLM.from_engine_args(EngineArgs(**engine_options(
        model, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 * 1024**2, max_loras=1)))
    thread = llm._thread
    try:
        seen = asyncio.run(scenarios(llm, model))
    finally:
        llm.shutdown()
    seen["thread_stopped"] = not thread.is_alive()
    Path(out).write_text(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:])
