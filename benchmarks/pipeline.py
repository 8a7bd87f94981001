"""The services on SmolLM2 with the vLLM backend, measured against their baselines in one run (ratios 1-5).

One workload: ``num_prompts`` reasoning-gym ``gsm_symbolic`` chat prompts x ``n_samples_per_prompt`` samples at
temperature 1, the generator's vLLM engine capped at ``max_num_seqs`` sequences per step (so a rollout larger
than the engine's batch runs in waves, as on a GPU with a large rollout), and the same engine arguments
everywhere (:func:`services.generator.vllm_engine.engine_options`). Two sampling modes:

- **fixed length** (``min_new_tokens = max_new_tokens``, unseeded): every backend samples exactly the same number
  of tokens, so tokens/s compare engines, not response lengths. Ratios 1 and 5.
- **natural** (stop at EOS, seeded): the generation-only run and the experience run sample the same tokens, so
  their times compare the same work. Ratios 2 and 3.

Figures (each a ratio of two timings taken here, in this run):

1. ``generator_service_vs_inprocess_vllm``: generator-service tokens/s over gRPC (a ``Generate`` stream read to
   the end) / ``vllm.LLM.generate`` tokens/s in a process of its own (:mod:`benchmarks.vllm_offline`).
2. ``first_batch_vs_last``: time to the first ExperienceBatch / time to the last, one group per batch,
   ``group_norm`` advantages (group-level: no batch-wide statistics).
3. ``experience_overhead_vs_generation``: (time to the last ExperienceBatch - natural generation time) /
   natural generation time: what scoring, the reference/actor forwards and streaming add to generation.
4. ``stream_vs_raw_bytes``: MB/s of the experience stream (the servicer's encoder, gRPC, the SDK's decoder into
   tensors; the ExperienceBatches of run 2 replayed by a server process of its own) / MB/s of the same
   serialized bytes sent as raw bytes over the same channel (no encoding or decoding).
5. ``vllm_vs_hf``: generator-service tokens/s with the vLLM backend / with the HF backend (fixed length).
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from fastexp import ExperienceClient, Sampling
from fastexp.channels import message_options
from fastexp.types import Experience
from fastexp.v1 import experience_pb2, generation_pb2, generation_pb2_grpc
from fastexp.wire import experience_from_pb, experience_to_pb, sampling_to_pb
from services.demo.datasets import reasoning_gym_problems
from services.launcher import LocalCluster, fresh_state_dir

MAX_MESSAGE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Workload:
    """The benchmark's prompts, sampling and engine limits."""

    num_prompts: int = 32
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 128
    max_num_seqs: int = 32
    kv_cache_memory_bytes: int = 2 * 1024**3
    max_model_len: int = 1024
    seed: int = 0
    stream_replays: int = 100  # times the experience batches are replayed for ratio 4
    experience_threads: int | None = 1  # the experience service's torch threads (None: one per core)


def run(model: str, workload: Workload, log_dir: Path) -> dict:
    """Measure ratios 1-5 on ``model`` (a local folder); returns the figures, their inputs and the workload."""
    from transformers import AutoTokenizer

    problems = reasoning_gym_problems("gsm_symbolic", workload.num_prompts, seed=workload.seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # rendered and tokenized as the experience service does (request.decode_request), so all runs see the same ids
    prompt_ids = [
        tokenizer(tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        for p in problems
    ]
    engine = {
        "max_model_len": workload.max_model_len, "kv_cache_memory_bytes": workload.kv_cache_memory_bytes,
        "max_num_seqs": workload.max_num_seqs, "seed": workload.seed,
    }
    fixed = Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, min_new_tokens=workload.max_new_tokens)
    natural = Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, seed=workload.seed)

    offline = _offline_vllm(model, engine, prompt_ids, workload, fixed, log_dir)
    overrides = {
        "generator": {"model": model, "backend": "vllm", **engine},
        # the forwards share the host's cores with the CPU engine: one thread avoids oversubscribing them
        "experience": {"actor_model": model, "reference_model": model, "torch_threads": workload.experience_threads},
    }
    with LocalCluster(overrides=overrides, log_dir=log_dir / "vllm",
                      state_dir=fresh_state_dir(log_dir / "vllm-state")) as cluster:
        generator = cluster.address("generator")
        generate_once(generator, prompt_ids[:2], 1, fixed)  # warm-up
        service = generate_once(generator, prompt_ids, workload.n_samples_per_prompt, fixed)
        generation = generate_once(generator, prompt_ids, workload.n_samples_per_prompt, natural)
        experience, batches = _make_experiences(cluster.address("experience"), problems, workload, natural)
    hf_overrides = {"generator": {"model": model, "backend": "hf", "max_model_len": workload.max_model_len,
                                  "hf_max_batch_size": workload.max_num_seqs}}
    with LocalCluster(overrides=hf_overrides, services=("generator",), log_dir=log_dir / "hf") as cluster:
        generate_once(cluster.address("generator"), prompt_ids[:2], 1, fixed)  # warm-up
        hf = generate_once(cluster.address("generator"), prompt_ids, workload.n_samples_per_prompt, fixed)
    stream = stream_vs_raw(batches, workload.stream_replays)
    return {
        "generator_service_vs_inprocess_vllm": service["tokens_per_s"] / offline["tokens_per_s"],
        "first_batch_vs_last": experience["first_batch_s"] / experience["last_batch_s"],
        "experience_overhead_vs_generation": (experience["last_batch_s"] - generation["seconds"])
        / generation["seconds"],
        "stream_vs_raw_bytes": stream["experience_mb_per_s"] / stream["raw_mb_per_s"],
        "vllm_vs_hf": service["tokens_per_s"] / hf["tokens_per_s"],
        "pipeline_inputs": {
            "inprocess_vllm_fixed": offline, "generator_service_vllm_fixed": service,
            "generator_service_hf_fixed": hf, "generator_service_vllm_natural": generation,
            "experience_natural": experience, "stream": stream,
        },
        "pipeline_workload": {**asdict(workload), "task": "gsm_symbolic", "model": model, "backend": "vllm"},
    }


def _offline_vllm(
    model: str, engine: dict, prompt_ids: list[list[int]], workload: Workload, sampling: Sampling, log_dir: Path
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({
            "model": model, "engine": engine, "prompt_token_ids": prompt_ids,
            "n_samples_per_prompt": workload.n_samples_per_prompt,
            "sampling": {"temperature": sampling.temperature, "max_new_tokens": sampling.max_new_tokens,
                         "min_new_tokens": sampling.min_new_tokens, "seed": sampling.seed},
        }))
        log_dir.mkdir(parents=True, exist_ok=True)
        with (log_dir / "vllm_offline.log").open("wb") as log:
            subprocess.run([sys.executable, "-m", "benchmarks.vllm_offline", str(spec), str(out)],
                           check=True, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
        return json.loads(out.read_text())


def generate_completions(address: str, prompt_ids: Sequence[Sequence[int]], n: int,
                         sampling: Sampling) -> tuple[float, list]:
    """One ``Generate`` stream read to the end: wall seconds from the call to the last message, and its completions
    (``fastexp.v1.Completion`` messages, in arrival order)."""
    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(token_ids=generation_pb2.TokenIds(ids=ids)) for ids in prompt_ids],
        sampling=sampling_to_pb(sampling), n_samples_per_prompt=n,
    )
    with grpc.insecure_channel(address, options=message_options(MAX_MESSAGE_BYTES)) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        started = time.perf_counter()
        completions = [c for response in stub.Generate(request, timeout=3600) for c in response.completions]
        seconds = time.perf_counter() - started
    return seconds, completions


def generate_once(address: str, prompt_ids: Sequence[Sequence[int]], n: int, sampling: Sampling) -> dict:
    """One ``Generate`` stream read to the end: tokens sampled, wall seconds from the call to the last message."""
    seconds, completions = generate_completions(address, prompt_ids, n, sampling)
    tokens = sum(len(c.output_token_ids) for c in completions)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _make_experiences(address: str, problems, workload: Workload, sampling: Sampling) -> tuple[dict, list]:
    with ExperienceClient(address) as client:
        client.wait_until_ready(600)
        started = time.perf_counter()
        arrivals, batches = [], []
        for experience in client.make_experiences(
            [list(p.messages) for p in problems], references=[p.reference for p in problems],
            n_samples_per_prompt=workload.n_samples_per_prompt, sampling=sampling,
            advantage_estimator="group_norm", micro_rollout_batch_size=workload.n_samples_per_prompt,
            packing_samples=True,
        ):
            arrivals.append(time.perf_counter() - started)
            batches.append(experience)
    tokens = sum(int(e.response_length.sum()) for e in batches)
    return {
        "first_batch_s": arrivals[0], "last_batch_s": arrivals[-1], "batches": len(batches), "tokens": tokens,
        "batch_arrival_s": [round(t, 3) for t in arrivals],
    }, batches


# ---------------------------------------------------------------------------------------------------------------
# Ratio 4: the experience stream against raw bytes on one channel
# ---------------------------------------------------------------------------------------------------------------

_SERVICE = "fastexp.bench.StreamBench"
_STREAM_ROUNDS = 3


def stream_vs_raw(batches: Sequence[Experience], replays: int) -> dict:
    """Stream ``batches`` ``replays`` times as ExperienceBatch (encoded per message by the server, decoded into
    tensors by the client) and their serialized bytes as raw messages, over one loopback channel; MB/s of each
    (MB = 10^6 bytes of serialized ExperienceBatch), the median of ``_STREAM_ROUNDS`` alternated rounds.

    The server runs in a process of its own, as the experience service does: in one process the encoder and the
    decoder would take turns on one interpreter lock, which a trainer and the service never share.
    """
    blobs = [experience_to_pb(e).SerializeToString() for e in batches]
    total = sum(len(b) for b in blobs) * replays
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    server = context.Process(target=_serve_stream, args=(blobs, replays, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=120)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=message_options(MAX_MESSAGE_BYTES)) as channel:
            decode = channel.unary_stream(f"/{_SERVICE}/Experiences", request_serializer=_identity,
                                          response_deserializer=experience_pb2.ExperienceBatch.FromString)
            plain = channel.unary_stream(f"/{_SERVICE}/Raw", request_serializer=_identity,
                                         response_deserializer=_identity)
            _consume(plain, lambda blob: None)  # warm the channel and the server up
            _consume(decode, experience_from_pb)
            raw_runs, experience_runs = [], []
            for _ in range(_STREAM_ROUNDS):  # alternated, so drift on the machine touches both alike
                raw_runs.append(_consume(plain, lambda blob: None))
                experience_runs.append(_consume(decode, experience_from_pb))
            raw_s, experience_s = statistics.median(raw_runs), statistics.median(experience_runs)
    finally:
        server.terminate()
        server.join(timeout=30)
    return {
        "bytes": total, "messages": len(blobs) * replays,
        "experience_mb_per_s": total / experience_s / 1e6, "raw_mb_per_s": total / raw_s / 1e6,
    }


def _identity(data: bytes) -> bytes:
    return data


def _serve_stream(blobs: list[bytes], replays: int, ports) -> None:
    """The ratio-4 server (child process): ``Experiences`` encodes each Experience per message as the servicer
    does; ``Raw`` sends the already-serialized bytes."""
    batches = [experience_from_pb(experience_pb2.ExperienceBatch.FromString(b)) for b in blobs]

    def experiences(_request: bytes, _context) -> Iterator[experience_pb2.ExperienceBatch]:
        for _ in range(replays):
            for experience in batches:
                yield experience_to_pb(experience)

    def raw(_request: bytes, _context) -> Iterator[bytes]:
        for _ in range(replays):
            yield from blobs

    handler = grpc.method_handlers_generic_handler(_SERVICE, {
        "Experiences": grpc.unary_stream_rpc_method_handler(
            experiences, request_deserializer=_identity, response_serializer=lambda m: m.SerializeToString()),
        "Raw": grpc.unary_stream_rpc_method_handler(raw, request_deserializer=_identity,
                                                    response_serializer=_identity),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=message_options(MAX_MESSAGE_BYTES))
    server.add_generic_rpc_handlers((handler,))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _consume(method, handle) -> float:
    started = time.perf_counter()
    for message in method(b"", timeout=600):
        handle(message)
    return time.perf_counter() - started
