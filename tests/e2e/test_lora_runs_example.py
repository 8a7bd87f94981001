"""Two trainers, two LoRA runs, one deployment (examples/lora_runs.py, issue 33), run end to end as a user runs it:
one deployment (SmolLM2 on the HF backend, bearer tokens on), two TRL GRPOTrainer processes at once, each
``FastexpRollout(run_id=...)`` with its own token, rank and target modules, two steps each. Checks what they wrote:
each trainer finished its steps and pushed its adapter before each step's rollouts (the service answered its run's
versions 1 and 2); each run's rows carry its own versions (1, then 2: the other run's two updates do not count);
the runs are two tenants' LoRA runs of different ranks; their step windows overlapped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smollm2

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lora_runs.py"
STEPS = 2


def test_two_trainers_train_two_lora_runs_on_one_deployment_at_once(smollm2_path, tmp_path):
    out = tmp_path / "lora-runs"
    command = [sys.executable, str(EXAMPLE), "demo", "--steps", str(STEPS), "--prompts-per-step", "2",
               "--num-generations", "2", "--max-completion-length", "16", "--backend", "hf", "--out", str(out)]
    done = subprocess.run(command, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert set(runs) == {"alice-lora", "bob-lora"}
    for run_id, run in runs.items():
        rows = [json.loads(line) for line in (out / run_id / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(1, STEPS + 1)) and run["steps"] == STEPS
        # the adapter was pushed before each step's rollouts, as the run's own next version ...
        assert [row["pushed_policy_version"] for row in rows] == list(range(1, STEPS + 1))
        # ... and each step's rows were sampled with it: the other run's updates never moved this run's versions
        assert [row["policy_versions"] for row in rows] == [[version] for version in range(1, STEPS + 1)]
        assert run["live_policy_version"] == STEPS  # GetRun after training
        assert all(0.0 <= row["reward_mean"] <= 1.0 for row in rows)
        assert all(row["started_at_unix_s"] < row["finished_at_unix_s"] for row in rows)
        assert (out / run_id / "train.log").stat().st_size > 0
    alice, bob = runs["alice-lora"], runs["bob-lora"]
    assert (alice["lora"]["rank"], bob["lora"]["rank"]) == (8, 16)
    assert alice["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert bob["lora"]["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    owners = {json.loads((out / run_id / "run.json").read_text())["owner"] for run_id in runs}
    assert len(owners) == 2 and all(owner.startswith("sha256:") for owner in owners)  # two tenants' tokens
    # both trainers were training at once: each run's first step began before the other's last step ended
    assert summary["overlapped"]
    assert alice["first_step_started_at_unix_s"] < bob["last_step_finished_at_unix_s"]
    assert bob["first_step_started_at_unix_s"] < alice["last_step_finished_at_unix_s"]
