"""A stream that survives the loss of its experience replica (issue 43): the time from a SIGKILL to the trainer's
next row, the work generated again, and the resumed stream's total time against an uninterrupted one.

Workload: SmolLM2 on the generator (``backend``), two experience replicas on one state store (an SQLite file both
processes open), one address in front of them (a TCP proxy, as a Service: each connection to the first replica
that accepts it). A trainer streams ``num_prompts`` x ``n_samples_per_prompt`` samples (one prompt group per
batch) through the proxy twice, one after the other: uninterrupted, then with the serving replica SIGKILLed right
after the trainer received ``kill_after_batches`` batches; the client resumes by itself on the other replica.

Figures (ratios and differences taken here, in this run):

- ``resume_next_row_excess_s``: seconds from the SIGKILL to the trainer's next row, less the uninterrupted stream's
  time to its first row (what one group takes from nothing: the regenerated group's own time) (target <= 5);
- ``resume_regenerated_vs_undelivered``: prompt groups the resumed open generated / the groups the trainer had not
  received when the replica was killed (target <= 1: only what was not delivered; below 1 when rows already on
  their way reached the trainer after the kill);
- ``resume_total_vs_uninterrupted_s``: the resumed stream's wall seconds / the uninterrupted stream's (informative:
  the lost replica's groups in progress are generated again).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fastexp import ExperienceClient, RequestOptions, Sampling
from services.demo.datasets import task_problems
from services.launcher import LocalCluster

REPLICAS = ("experience", "experience-1")


@dataclass(frozen=True)
class ResumeWorkload:
    """The stream measured with and without a replica's loss."""

    task: str = "basic_arithmetic"
    num_prompts: int = 8
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 64
    kill_after_batches: int = 3
    backend: str = "vllm"
    seed: int = 0


def run(model: str, workload: ResumeWorkload, log_dir: Path) -> dict:
    """Measure on ``model`` (a local folder); returns the figures, their inputs and the workload."""
    from tests.support.proxies import TcpProxy
    from tests.support.resumes import groups_regenerated, serving_replica

    options = RequestOptions(
        n_samples_per_prompt=workload.n_samples_per_prompt, advantage_estimator="rloo", reward_running_norm=True,
        micro_rollout_batch_size=workload.n_samples_per_prompt,
        sampling=Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, ignore_eos=True),
    )
    prompts = [list(p.messages) for p in task_problems(workload.task, workload.num_prompts, seed=workload.seed)]
    root = log_dir / "resume"
    overrides = {
        "generator": {"model": model, "backend": workload.backend},
        "experience": {"actor_model": model, "reference_model": model, "state_url": f"sqlite:///{root / 'state.db'}",
                       "weights_dir": str(root / "weights"), "upstream_probe_interval_s": 0.5,
                       # a window of one group: the killed replica has at most a group or two in progress
                       "max_groups_ahead": 1},
    }
    with LocalCluster(overrides=overrides, log_dir=root, experience_replicas=2) as cluster:
        proxy = TcpProxy([cluster.address(name) for name in REPLICAS])
        try:
            with ExperienceClient(proxy.address) as client:
                client.wait_until_ready(900)
                list(client.make_experiences(prompts[:1], options))  # warm-up
                whole = _stream(client, prompts, options)
                broken = _stream(client, prompts, options, kill=lambda: cluster.kill(serving_replica(cluster, proxy, REPLICAS)),
                                 kill_after=workload.kill_after_batches)
        finally:
            proxy.close()
        regenerated = groups_regenerated(cluster, REPLICAS)
    undelivered = workload.num_prompts - workload.kill_after_batches
    inputs = {"uninterrupted": whole, "killed": broken, "groups_regenerated": regenerated,
              "groups_undelivered_at_kill": undelivered}
    next_row = broken["kill_to_next_row_s"]  # None: every row had reached the trainer before the kill
    return {
        "resume_next_row_excess_s": None if next_row is None else next_row - whole["first_row_s"],
        "resume_regenerated_vs_undelivered": regenerated / undelivered,
        "resume_total_vs_uninterrupted_s": broken["wall_s"] / whole["wall_s"],
        "resume_inputs": inputs, "resume_workload": asdict(workload),
    }


def _stream(client: ExperienceClient, prompts: list, options: RequestOptions, kill=None, kill_after: int = 0) -> dict:
    """One stream's timings: wall, first row, and (with ``kill``) SIGKILL to the next row."""
    started = time.perf_counter()
    first_row = killed_at = next_row = None
    batches = 0
    for _ in client.make_experiences(prompts, options):
        now = time.perf_counter()
        first_row = first_row if first_row is not None else now - started
        if killed_at is not None and next_row is None:
            next_row = now - killed_at
        batches += 1
        if kill is not None and batches == kill_after:
            kill()
            killed_at = time.perf_counter()
    timings = {"wall_s": time.perf_counter() - started, "first_row_s": first_row, "batches": batches,
               "resumes": client.last_stream_stats.get("resumes", 0)}
    return timings | ({"kill_to_next_row_s": next_row} if kill is not None else {})
