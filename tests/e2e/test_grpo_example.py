"""The closed-loop example runs end to end (one tiny step on the HF backend): experiences -> LoRA step ->
UpdateWeights -> evaluation, with its metrics, summary and reward-curve PNG written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smollm2

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic.py"


def test_grpo_example_closes_the_loop(smollm2_path, tmp_path):
    out = tmp_path / "grpo"
    command = [sys.executable, str(EXAMPLE), "--steps", "1", "--prompts-per-step", "2", "--n-samples-per-prompt", "2",
               "--eval-size", "2", "--max-new-tokens", "8", "--backend", "hf", "--out", str(out)]
    subprocess.run(command, check=True, timeout=600, capture_output=True)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(line for line in lines if "reward_mean" in line)
    assert step["policy_version_sampled"] == 0 and step["policy_version_now"] == 1  # the update went live
    assert [line["step"] for line in lines if "held_out_accuracy" in line] == [0, 1]
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["held_out_accuracy_after"] <= 1.0
    assert (out / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
