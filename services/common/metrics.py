"""Prometheus metrics of the three services (prometheus-client), and the HTTP endpoint that exposes them.

Every metric lives in the process's default registry and is named ``fastexp_<what>_<unit>`` following Prometheus
conventions (``_total`` on counters, base units: seconds, tokens, nats). A service exposes ``/metrics`` on its
``metrics_port`` setting (off when unset). The series and what to watch are listed in README "Operations".

gRPC server metrics follow the go-grpc-prometheus names (``grpc_service``, ``grpc_method``, ``grpc_code``) so
existing dashboards and alerts apply; :class:`services.common.observing.ObservingInterceptor` records them for every
method. This module imports no gRPC: cores count and time their stages here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:  # annotations only
    from fastexp.types import Experience

# Latencies from 1 ms to 10 min: a forward micro-batch is ~0.1-10 s, a whole stream minutes.
_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

GRPC_HANDLED = Counter(
    "fastexp_grpc_server_handled", "gRPC calls finished, by method and status code",
    ["grpc_service", "grpc_method", "grpc_code"],
)
GRPC_HANDLING_SECONDS = Histogram(
    "fastexp_grpc_server_handling_seconds", "Time from a call's start to its last message or status",
    ["grpc_service", "grpc_method"], buckets=_SECONDS,
)
STAGE_SECONDS = Histogram(
    "fastexp_stage_duration_seconds",
    "Time in one pipeline stage: generate (a prompt group, submit to last sample), score (a group), episodes (a "
    "multi-turn group's n episodes, start to done), actor, reference, critic (a forward over ready groups), "
    "advantages (a batch), stream (a batch handed to the trainer)",
    ["stage"], buckets=_SECONDS,
)
STATE_STORE_SECONDS = Histogram(
    "fastexp_state_store_seconds",
    "Time of one call to the experience tier's state store (waiting for a connection included), by what it did: "
    "CreateRun, opening a stream slot, running statistics (one per delivered batch), reading live versions, ...",
    ["operation"], buckets=_SECONDS,
)
STATE_STORE_FAILURES = Counter(
    "fastexp_state_store_failures", "Calls to the state store that failed because it was unreachable or too slow",
    ["operation"],
)
WEIGHTS_BLOB_SECONDS = Histogram(
    "fastexp_weights_blob_seconds",
    "Time to write a version's weights as a blob (put) or to read and verify one (open)",
    ["operation"], buckets=_SECONDS,
)
CATCH_UPS = Counter(
    "fastexp_catch_ups", "Live versions made through another experience replica and loaded here, by what",
    ["model"],
)
GENERATED_TOKENS = Counter("fastexp_generated_tokens", "Response tokens sampled by the generator", ["backend"])
GENERATION_REQUESTS_IN_FLIGHT = Gauge(
    "fastexp_generation_requests_in_flight", "Sequences submitted to the engine and not yet finished"
)
GENERATOR_CPU_THREADS = Gauge(
    "fastexp_generator_cpu_threads", "Threads a CPU engine's model runs on (SetCpuThreads; 0: not adjustable)"
)
ENGINE_THREAD_CHANGES = Counter(
    "fastexp_engine_thread_changes_total",
    "SetCpuThreads calls the experience service made to a CPU engine sharing its host, by the threads set "
    "(to: shared, while forward passes wait; all, once none does)", ["to"],
)
POLICY_VERSION = Gauge(
    "fastexp_policy_version", "Weights version now serving (generator) or live (experience: its actor replica)",
    ["service"],
)
QUEUE_DEPTH = Gauge(
    "fastexp_queue_depth",
    "Prompt groups waiting in the experience pipeline: scored (awaiting a forward), forwarded (awaiting a batch)",
    ["queue"],
)
DEPENDENCY_UP = Gauge(
    "fastexp_dependency_up",
    "1 while a dependency answers the experience service's readiness probes (generator, scorer), else 0",
    ["dependency"],
)
GENERATOR_REPLICA_UP = Gauge(
    "fastexp_generator_replica_up",
    "1 while a generator replica gets work from the experience service (serving at the fleet's policy version)",
    ["replica"],
)
GENERATOR_REPLICA_IN_FLIGHT = Gauge(
    "fastexp_generator_replica_in_flight_samples", "Samples the experience service sent a generator replica and "
    "has not received yet", ["replica"],
)
GENERATOR_REPLICA_VERSION = Gauge(
    "fastexp_generator_replica_policy_version", "Policy version a generator replica reported last (-1: unknown)",
    ["replica"],
)
GENERATOR_REPLICA_TOKENS = Counter(
    "fastexp_generator_replica_tokens", "Response tokens received from a generator replica (rate: its tokens/s)",
    ["replica"],
)
REROUTED_GROUPS = Counter(
    "fastexp_rerouted_groups", "Prompt groups taken from a failed generator replica and generated again elsewhere",
    ["replica"],
)
ACTIVE_STREAMS = Gauge("fastexp_active_streams", "MakeExperiences streams being served")
# Resumable streams (stream_id): opens that resumed a broken stream, the prompt groups they had to generate (the
# client did not hold them: lost with the broken open, or never started), the response tokens those opens
# delivered (the cost of the resumes), and streams this replica handed over when it stopped (drained).
STREAMS_RESUMED = Counter("fastexp_streams_resumed", "MakeExperiences opens that resumed a broken stream")
GROUPS_REGENERATED = Counter("fastexp_groups_regenerated", "Prompt groups generated by resumed stream opens")
RESUMED_TOKENS = Counter("fastexp_resumed_tokens", "Response tokens delivered by resumed stream opens")
STREAMS_DRAINED = Counter("fastexp_streams_drained", "Streams handed over (UNAVAILABLE, fastexp-drained) at stop")
EXPERIENCE_SAMPLES = Counter("fastexp_experience_samples", "Samples (rows) streamed to trainers")
# Per created run (at most the operator's max_runs label values; a deleted run's series are removed). The run's
# live gauges (streams, version, groups in flight and queued) are read at scrape time: services.experience.runs.metrics.
RUN_SAMPLES = Counter("fastexp_run_samples", "Samples (rows) streamed to a run's trainer", ["run_id"])
RUN_TOKENS = Counter("fastexp_run_tokens", "Response tokens streamed to a run's trainer", ["run_id"])
VISION_TOKEN_REPAIRS = Counter(
    "fastexp_vision_token_repairs",
    "Image/video placeholder mismatches repaired: response_placeholder = sampled placeholder tokens replaced by "
    "the pad token; prompt_mismatch = rows whose generator prompt ids differed from the processor's",
    ["kind"],
)
REWARD = Histogram(
    "fastexp_reward", "Scorer reward per sample, before shaping",
    buckets=(-10, -5, -2, -1, -0.5, -0.1, 0, 0.1, 0.5, 1, 2, 5, 10),
)
KL_NATS = Histogram(
    "fastexp_kl_nats", "Mean per-token KL(actor || reference) estimate of a sample, in nats",
    buckets=(0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
)
REWARD_SOURCE_SECONDS = Histogram(
    "fastexp_reward_source_duration_seconds", "Time a reward source took for one batch of items",
    ["source"], buckets=_SECONDS,
)
REMOTE_REWARD_REQUESTS = Counter(
    "fastexp_remote_reward_requests", "HTTP requests to remote reward endpoints, by outcome (ok, error, timeout)",
    ["endpoint", "outcome"],
)
REMOTE_REWARD_RETRIES = Counter("fastexp_remote_reward_retries", "Retried remote reward requests", ["endpoint"])
REMOTE_REWARD_FAILURES = Counter(
    "fastexp_remote_reward_failures", "Items a remote reward endpoint could not score after its retries",
    ["endpoint"],
)


# Networked reward sources (remote reward models, LLM judges) through the scorer's gateway: per source.
SOURCE_CALLS = Counter(
    "fastexp_reward_source_calls",
    "Outbound calls of networked reward sources (a judge batch, an HTTP request), by outcome: ok, error, timeout, "
    "rejected (4xx), breaker_open (refused by the circuit breaker), budget_timeout (deadline passed while queued "
    "for the budget), cancelled (the request was cancelled)", ["source", "outcome"],
)
SOURCE_CALL_SECONDS = Histogram(
    "fastexp_reward_source_call_duration_seconds", "Time of one admitted outbound call, sent to answered",
    ["source"], buckets=_SECONDS,
)
SOURCE_BUDGET_WAIT_SECONDS = Histogram(
    "fastexp_reward_source_budget_wait_seconds", "Time a call queued for its source's budget (concurrency, "
    "requests/min, tokens/min)", ["source"], buckets=_SECONDS,
)
SOURCE_IN_FLIGHT = Gauge("fastexp_reward_source_in_flight", "Outbound calls of a source in flight", ["source"])
SOURCE_TOKENS = Counter(
    "fastexp_reward_source_tokens", "Tokens a judge spent, by kind: prompt, completion", ["source", "kind"]
)
SOURCE_BREAKER_STATE = Gauge(
    "fastexp_reward_source_breaker_state", "A source's circuit breaker: 0 closed, 1 half-open, 2 open", ["source"]
)
SOURCE_CACHE_LOOKUPS = Counter(
    "fastexp_reward_source_cache_lookups",
    "Reward cache lookups per item, by result: hit (cached), shared (same item earlier in the same request), miss "
    "(scored), error (the cache did not answer: scored)", ["source", "result"],
)
JUDGE_UNPARSED_VERDICTS = Counter(
    "fastexp_judge_unparsed_verdicts", "Judge answers without a usable verdict (no match, or outside score_range)",
    ["source"],
)


def start_metrics_server(host: str, port: int) -> int:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port (``port=0`` picks one).

    Raises:
        OSError: the address could not be bound.
    """
    server, _thread = start_http_server(port, addr=host)
    return server.server_port


def stage_timer(stage: str):
    """``with stage_timer("score"):`` observes the block's wall time in ``fastexp_stage_duration_seconds``
    (prometheus-client's own timer, ``time.perf_counter``)."""
    return STAGE_SECONDS.labels(stage).time()


def observe_distributions(experience: Experience) -> None:
    """Each row's reward and mean per-token KL (nats, over ``action_mask``) into their histograms."""
    for reward in experience.reward.tolist():
        if math.isfinite(reward):  # a NaN would poison the histogram's sum for good
            REWARD.observe(reward)
    if experience.kl is None:  # no reference ran
        return
    mask = experience.action_mask.float()
    for row_kl in ((experience.kl * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).tolist():
        if math.isfinite(row_kl):
            KL_NATS.observe(row_kl)
