"""A trainer's environment with only the client's dependencies (``pip install fastexp``: grpcio, protobuf, numpy,
torch) streams experiences from the real services and sends a weight update; none of the server side's packages
(transformers, vLLM, pydantic, ...) is installed there."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastexp.launcher import LocalCluster

pytestmark = [pytest.mark.smollm2]

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("transformers", "vllm", "pydantic", "typer", "fastapi")

TRAINER = """
import importlib.util, json, sys
import torch
from fastexp import ExperienceClient, RequestOptions, Sampling

options = RequestOptions(n_samples_per_prompt=2, advantage_estimator="rloo", sampling=Sampling(max_new_tokens=6))
with ExperienceClient(sys.argv[1], timeout_s=300) as client:
    client.wait_until_ready(300)
    rows = [(p, s) for e in client.make_experiences(["Say hi.", "Count to 3."], options)
            for p, s in zip(e.prompt_index, e.sample_index)]
    update = client.update_weights([("model.norm.weight", torch.ones(64))])
found = {name: importlib.util.find_spec(name) is not None for name in sys.argv[2].split(",")}
print(json.dumps({"rows": sorted(rows), "policy_version": update.policy_version, "installed": found}))
"""


def _source_copy(folder: Path) -> Path:
    """The project's files as a clean checkout has them, plus the generated code (pip builds in the tree)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in [*tracked, *(str(p.relative_to(ROOT)) for p in (ROOT / "fastexp" / "v1").glob("*_pb2*.py"))]:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return folder


def test_a_trainer_venv_with_only_the_client_dependencies_streams_and_updates(tiny_model_path, tmp_path):
    venv = tmp_path / "trainer-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # the trainer's own torch first (here the machine's CPU build), then fastexp with its base dependencies only
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=900)
    subprocess.run([*pip, str(_source_copy(tmp_path / "src"))], check=True, timeout=900)
    overrides = {
        "generator": {"model": tiny_model_path, "backend": "hf", "dtype": "float32"},
        "experience": {"actor_model": tiny_model_path, "reference_model": tiny_model_path, "dtype": "float32",
                       "torch_threads": 1},
    }
    with LocalCluster(overrides=overrides, log_dir=tmp_path / "logs") as cluster:
        result = subprocess.run(
            [str(venv / "bin" / "python"), "-c", TRAINER, cluster.address("experience"),
             ",".join(SERVER_ONLY)],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,  # not the repository: the installed package
        )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rows"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert report["policy_version"] == 1
    assert not any(report["installed"].values()), report["installed"]  # the client installed light
