"""Eight concurrent MakeExperiences streams share one generator and all complete, each with every group exactly
once (the load benchmark's own run, small: ``make load`` is the measurement)."""

from __future__ import annotations

import pytest

from benchmarks.load import LoadConfig, jain_index, percentile, run
from services.launcher import LocalCluster

pytestmark = [pytest.mark.smollm2]


def test_eight_concurrent_streams_all_complete_and_share_the_generator(smollm2_path, tmp_path):
    config = LoadConfig(streams=8, prompts_per_stream=1, n_samples_per_prompt=2, max_new_tokens=16, backend="hf")
    overrides = {
        "generator": {"model": smollm2_path, "backend": "hf"},
        "experience": {"actor_model": smollm2_path, "reference_model": smollm2_path, "torch_threads": 1},
    }
    with LocalCluster(overrides=overrides, log_dir=tmp_path / "logs") as cluster:
        summary = run(config, cluster.address("experience"))
    assert summary["errors"] == [] and summary["all_complete"], summary
    assert summary["streams_complete"] == 8
    # no stream waits for all the others: the slowest finishes within 4x the median stream's time
    completion = sorted(summary["completion_s"])
    assert completion[-1] <= 4 * completion[len(completion) // 2], completion


def test_summary_statistics():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0, 4.0], 99) == 4.0
    assert jain_index([1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
