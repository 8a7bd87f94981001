"""Two trainers, two LoRA runs, one deployment: two TRL GRPOTrainers train their own LoRA adapters at the same time.

One deployment (the three services, SmolLM2-135M-Instruct on the HF backend, bearer tokens on the experience
service) serves two tenants, alice and bob. Each runs its own trainer process: TRL's ``GRPOTrainer`` with a peft
LoRA adapter of its own rank, target modules, learning rate and problems, and
``FastexpRollout(address, token=<its token>, run_id=<its run>)``, which creates the tenant's *LoRA run* from the
adapter's ``LoraConfig``, pushes the adapter itself (``update_weights(run_id=...)``) before the first rollout and
after each step, and streams with the run's id::

    GRPOTrainer(..., peft_config=LoraConfig(r=8, ...),
                rollout_func=FastexpRollout(address, dataset=train, token=token, run_id="alice-lora"),
                reward_funcs=[fastexp_reward])

The generator samples each run's rows with that run's adapter; every row carries the run's own adapter version
(1 before the first optimizer step, 2 after it, ...), whatever the other run did meanwhile. The trainers wait for
each other once their models are loaded, so their steps run at the same time.

Run (``make lora-demo``; about a minute and a half on 2 CPU cores with the defaults, the services' start included)::

    .venv/bin/python examples/lora_runs.py demo --steps 3 --out out/lora-runs

Writes ``<out>/<run_id>/metrics.jsonl`` per trainer (per step: the reward, the run's versions that sampled the
step's rows, the version pushed before them, seconds pushing and sampling, and the step's start and end as Unix
times), ``<out>/<run_id>/run.json`` (the run as ``GetRun`` reported it after training), ``<out>/summary.json`` (per
run: first and last reward, versions seen, steps, its first step's start and last step's end; whether the two
runs overlapped), the trainers' logs ``<out>/<run_id>/train.log`` and the services' in ``<out>/logs``; prints a
table.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import typer
from transformers import TrainerCallback

# plain tracebacks: typer's rich ones may show locals, and the demo's hold the tenants' tokens
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0],
                  pretty_exceptions_enable=False)
logger = logging.getLogger("lora_runs")
TASK = "basic_arithmetic"
TOKEN_ENV = "FASTEXP_LORA_DEMO_TOKEN"  # a trainer's bearer token reaches it here, not on its command line
READY = "LORA-DEMO-READY"  # a trainer prints it once its model is loaded, then waits for "go" on stdin
READY_TIMEOUT_S = 600.0  # how long a trainer may take to import TRL and load its model before the demo gives up


@dataclass(frozen=True)
class Tenant:
    """One trainer: its tenant name (its token's), run id, LoRA rank and target modules, learning rate, seed."""

    name: str
    run_id: str
    lora_rank: int
    target_modules: tuple[str, ...]
    learning_rate: float
    seed: int


TENANTS = (
    Tenant("alice", "alice-lora", 8, ("q_proj", "v_proj"), 2e-4, 1),
    Tenant("bob", "bob-lora", 16, ("q_proj", "k_proj", "v_proj", "o_proj"), 1e-4, 2),
)


@app.command()
def demo(
    steps: int = typer.Option(3, help="GRPO steps of each trainer"),
    prompts_per_step: int = typer.Option(2, help="problems per step"),
    num_generations: int = typer.Option(4, help="GRPO group size"),
    max_completion_length: int = typer.Option(48, help="most tokens per answer"),
    backend: str = typer.Option("hf", help="generator backend: hf, vllm or auto"),
    out: Path = typer.Option("out/lora-runs", help="output folder"),  # noqa: B008 - typer converts the str
) -> None:
    """Start one deployment with two tenants' tokens, run both trainers at once, write and print the summary."""
    from services.common.models import resolve_model
    from services.launcher import LocalCluster, fresh_state_dir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM as Ctrl-C: unwind, so the trainers and the services are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out.mkdir(parents=True, exist_ok=True)
    tokens = {tenant.name: secrets.token_urlsafe(24) for tenant in TENANTS}
    secrets_dir = out / "secrets"
    secrets_dir.mkdir(mode=0o700, exist_ok=True)
    tokens_file = secrets_dir / "call-tokens"
    tokens_file.write_text("".join(f"{token}\n" for token in tokens.values()))
    tokens_file.chmod(0o600)
    model_path = resolve_model("smollm2-135m-instruct")
    overrides = {"generator": {"model": model_path, "backend": backend, "max_model_len": 1024},
                 "experience": {"actor_model": model_path, "reference_model": model_path,
                                "auth_tokens_file": tokens_file}}
    sizes = ["--steps", str(steps), "--prompts-per-step", str(prompts_per_step), "--num-generations",
             str(num_generations), "--max-completion-length", str(max_completion_length), "--out", str(out)]
    started = time.monotonic()
    with LocalCluster(overrides=overrides, log_dir=out / "logs", state_dir=fresh_state_dir(out / "state")) as cluster:
        logger.info("deployment SERVING after %.0f s; starting %d trainers", time.monotonic() - started, len(TENANTS))
        run_trainers([Trainer.start(t, cluster.address("experience"), tokens[t.name], sizes, out) for t in TENANTS])
    summary = summarize(out, time.monotonic() - started)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)


@dataclass
class Trainer:
    """A trainer process: its tenant, the process, and its output copied to ``<out>/<run_id>/train.log`` by a
    thread that sets ``said_ready`` and ``ready`` on the :data:`READY` line, or only ``ready`` when the output
    ends without it (the process died)."""

    tenant: Tenant
    process: subprocess.Popen
    ready: threading.Event
    log: Path
    said_ready: bool = False

    @classmethod
    def start(cls, tenant: Tenant, address: str, token: str, sizes: list[str], out: Path) -> Trainer:
        folder = out / tenant.run_id
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "train", "--address", address,
                   "--run-id", tenant.run_id, "--lora-rank", str(tenant.lora_rank),
                   "--target-modules", ",".join(tenant.target_modules), "--learning-rate", str(tenant.learning_rate),
                   "--seed", str(tenant.seed), *sizes]
        # one torch thread each: the two trainers and the services share the cores
        env = {**os.environ, TOKEN_ENV: token, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
        process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                   preexec_fn=_die_with_parent)
        trainer = cls(tenant, process, threading.Event(), folder / "train.log")
        threading.Thread(target=trainer._copy_output, name=f"{tenant.name}-output", daemon=True).start()
        return trainer

    def _copy_output(self) -> None:
        with self.log.open("w") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                if line.startswith(READY):
                    self.said_ready = True
                    self.ready.set()
        self.ready.set()  # the output ended: the process exited (run_trainers looks at its code)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text() if self.log.exists() else ""
        return f"\n--- last lines of {self.log} ---\n" + "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the trainer's process group, SIGKILL it after ``grace_s``."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _die_with_parent() -> None:
    """In a trainer's process before it runs: SIGTERM when the demo dies (Linux ``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def run_trainers(trainers: list[Trainer]) -> None:
    """Let the trainers go together once every one has loaded its model, wait for all of them; stop them all
    however this ends (a failure, Ctrl-C).

    Raises:
        RuntimeError: a trainer exited before it was ready, or with a non-zero code (named, with its log's tail).
    """
    try:
        for trainer in trainers:
            if not trainer.ready.wait(READY_TIMEOUT_S):
                raise RuntimeError(f"trainer {trainer.tenant.run_id} did not load its model within "
                                   f"{READY_TIMEOUT_S:.0f} s" + trainer.tail())
            if not trainer.said_ready:
                raise RuntimeError(f"trainer {trainer.tenant.run_id} exited with code {trainer.process.wait()} "
                                   f"before its model was loaded" + trainer.tail())
        for trainer in trainers:  # the barrier: every trainer is ready, all start their first step now
            try:
                trainer.process.stdin.write("go\n")
                trainer.process.stdin.flush()
            except BrokenPipeError:
                raise RuntimeError(f"trainer {trainer.tenant.run_id} exited with code {trainer.process.wait()} "
                                   f"while the others loaded" + trainer.tail()) from None
        logger.info("all trainers ready: training")
        for trainer in trainers:
            if trainer.process.wait() != 0:
                raise RuntimeError(f"trainer {trainer.tenant.run_id} exited with code {trainer.process.returncode}"
                                   + trainer.tail())
    finally:
        for trainer in trainers:
            trainer.stop()


@app.command()
def train(
    address: str = typer.Option(..., help="the experience service, host:port"),
    run_id: str = typer.Option(..., help="this trainer's LoRA run"),
    lora_rank: int = typer.Option(8, help="LoRA rank (lora_alpha: twice it)"),
    target_modules: str = typer.Option("q_proj,v_proj", help="comma-separated modules the adapter adapts"),
    learning_rate: float = typer.Option(2e-4, help="AdamW learning rate of the adapter"),
    seed: int = typer.Option(0, help="problems' and trainer's seed"),
    steps: int = typer.Option(3, help="GRPO steps"),
    prompts_per_step: int = typer.Option(2, help="problems per step"),
    num_generations: int = typer.Option(4, help="GRPO group size"),
    max_completion_length: int = typer.Option(48, help="most tokens per answer"),
    out: Path = typer.Option("out/lora-runs", help="output folder (this run's files go to <out>/<run_id>)"),  # noqa: B008
) -> None:
    """One trainer (the demo starts two): GRPOTrainer on a LoRA adapter trained as the run ``run_id``, its token
    from ``$FASTEXP_LORA_DEMO_TOKEN``. Prints the ready line once its model is loaded and waits for "go" on stdin
    before training."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from fastexp.integrations.trl import FastexpRollout, fastexp_reward
    from services.common.models import resolve_model
    from services.demo.datasets import task_problems

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {run_id} %(name)s %(message)s")
    torch.set_num_threads(1)
    folder = out / run_id
    model_path = resolve_model("smollm2-135m-instruct")
    problems = task_problems(TASK, steps * prompts_per_step, seed=seed)
    dataset = datasets.Dataset.from_list([{"prompt": list(p.messages), "answer": p.reference} for p in problems])
    args = GRPOConfig(
        output_dir=str(folder / "trainer"), max_steps=steps, per_device_train_batch_size=prompts_per_step * num_generations,
        num_generations=num_generations, max_completion_length=max_completion_length, temperature=1.0,
        learning_rate=learning_rate, beta=0.0, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, seed=seed, disable_tqdm=True,
    )
    clock = StepClock()
    with FastexpRollout(address, dataset=dataset, token=os.environ[TOKEN_ENV], run_id=run_id) as rollout:
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_path, dtype="float32"),
            processing_class=AutoTokenizer.from_pretrained(model_path), args=args, train_dataset=dataset,
            peft_config=LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                   target_modules=target_modules.split(",")),
            rollout_func=rollout, reward_funcs=[fastexp_reward], callbacks=[clock],
        )
        print(READY, run_id, flush=True)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit(f"{run_id}: the demo did not say go")
        trainer.train()
        run = rollout.client.get_run(run_id)
    write_metrics(folder, trainer.state.log_history, rollout.calls, clock)
    lora = run.lora
    (folder / "run.json").write_text(json.dumps({
        "run_id": run.run_id, "policy_version": run.policy_version, "owner": run.owner,
        "lora": {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)} if lora else None,
    }, indent=2) + "\n")


class StepClock(TrainerCallback):
    """Notes each step's start and end as Unix times (comparable across the trainers' processes)."""

    def __init__(self) -> None:
        self.started: list[float] = []
        self.finished: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ARG002 - transformers' signature
        self.started.append(time.time())

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ARG002
        self.finished.append(time.time())


def write_metrics(folder: Path, log_history: list[dict], calls: list, clock: StepClock) -> None:
    """``<folder>/metrics.jsonl``: one line per step from TRL's log, the rollout's calls and the step clock."""
    logs = [entry for entry in log_history if "reward" in entry]
    rows = [
        {"step": i + 1, "reward_mean": log["reward"], "reward_std": log["reward_std"],
         "policy_versions": sorted(set(call.policy_versions)), "pushed_policy_version": call.pushed_policy_version,
         "update_s": call.update_s, "rollout_s": call.rollout_s, "started_at_unix_s": start, "finished_at_unix_s": end}
        for i, (log, call, start, end) in enumerate(zip(logs, calls, clock.started, clock.finished, strict=True))
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def summarize(out: Path, wall_s: float) -> dict:
    """Per run: its steps, first and last reward, the versions its rows carried and those pushed, its LoRA spec,
    its first step's start and last step's end; and whether every two runs' step windows overlapped."""
    runs = {}
    for tenant in TENANTS:
        folder = out / tenant.run_id
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        run = json.loads((folder / "run.json").read_text())
        runs[tenant.run_id] = {
            "tenant": tenant.name, "lora": run["lora"], "steps": len(rows),
            "reward_first": rows[0]["reward_mean"], "reward_last": rows[-1]["reward_mean"],
            "policy_versions_per_step": [row["policy_versions"] for row in rows],
            "pushed_policy_versions": [row["pushed_policy_version"] for row in rows],
            "live_policy_version": run["policy_version"],
            "first_step_started_at_unix_s": rows[0]["started_at_unix_s"],
            "last_step_finished_at_unix_s": rows[-1]["finished_at_unix_s"],
        }
    windows = [(r["first_step_started_at_unix_s"], r["last_step_finished_at_unix_s"]) for r in runs.values()]
    overlap_s = min(end for _, end in windows) - max(start for start, _ in windows)
    return {"runs": runs, "overlapped": overlap_s > 0, "overlap_s": overlap_s, "wall_s": wall_s}


def print_summary(summary: dict) -> None:
    print("run         rank  steps  reward first -> last  versions per step      live version")
    for run_id, run in summary["runs"].items():
        versions = " ".join(",".join(map(str, v)) for v in run["policy_versions_per_step"])
        print(f"{run_id:<10}  {run['lora']['rank']:>4}  {run['steps']:>5}  {run['reward_first']:>12.3f} -> "
              f"{run['reward_last']:.3f}  {versions:<21}  {run['live_policy_version']:>12}")
    print(f"step windows overlapped: {summary['overlapped']} ({summary['overlap_s']:.1f} s); "
          f"wall time {summary['wall_s']:.0f} s")


if __name__ == "__main__":
    app()
