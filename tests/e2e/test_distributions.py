"""The two distributions, built as wheels and installed into clean virtualenvs, work together.

``fastexp`` (client/, the trainer's client) goes into a trainer's environment with its base dependencies only
(grpcio, protobuf, numpy, torch): no command line, no top-level ``services``, none of the server's packages.
``fastexp-server`` (the root project: the services and the ``fastexp`` command) goes into an environment of its
own and runs the services; the trainer's environment streams experiences from them and sends a weight update.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher import LocalCluster

pytestmark = [pytest.mark.smollm2]

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("transformers", "vllm", "pydantic", "typer", "fastapi", "services")
PIP = ("-m", "pip", "install", "-q", "--disable-pip-version-check")

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
    """The project's files (tracked and new, not ignored ones), plus the generated code (`make proto`)."""
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    generated = (ROOT / "client" / "fastexp" / "v1").glob("*_pb2*.py*")
    for name in [*tracked, *(str(p.relative_to(ROOT)) for p in generated)]:
        if (ROOT / name).is_file():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target)
    return folder


def _wheels(tmp_path: Path) -> tuple[Path, Path]:
    source, dist = _source_copy(tmp_path / "src"), tmp_path / "dist"
    for project in (source / "client", source):
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(project)],
                       check=True, timeout=900)
    (client,), (server,) = dist.glob("fastexp-*.whl"), dist.glob("fastexp_server-*.whl")
    return client, server


def _venv(folder: Path, *requirements: str) -> Path:
    """A clean virtualenv with ``requirements`` (torch first: the machine's CPU build, as a trainer has its own)."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    subprocess.run([str(python), *PIP, "torch==2.13.0"], check=True, timeout=900)
    subprocess.run([str(python), *PIP, *requirements], check=True, timeout=1800)
    return python


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    return _wheels(tmp_path_factory.mktemp("wheels"))


def test_the_client_wheel_installs_alone_and_streams_from_the_server_wheel(wheels, tiny_model_path, tmp_path,
                                                                          monkeypatch):
    client_wheel, server_wheel = wheels
    trainer = _venv(tmp_path / "trainer-venv", str(client_wheel))
    server = _venv(tmp_path / "server-venv", str(client_wheel), str(server_wheel))
    assert not (trainer.parent / "fastexp").exists()  # the client installs no command
    help_text = subprocess.run([str(server.parent / "fastexp"), "--help"], capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "serve" in help_text.stdout, help_text.stderr[-2000:]
    monkeypatch.chdir(tmp_path)  # not the repository: the services import the installed wheel
    overrides = {
        "generator": {"model": tiny_model_path, "backend": "hf", "dtype": "float32"},
        "experience": {"actor_model": tiny_model_path, "reference_model": tiny_model_path, "dtype": "float32",
                       "torch_threads": 1},
    }
    with LocalCluster(overrides=overrides, log_dir=tmp_path / "logs", python=str(server)) as cluster:
        result = subprocess.run(
            [str(trainer), "-c", TRAINER, cluster.address("experience"), ",".join(SERVER_ONLY)],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rows"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert report["policy_version"] == 1
    assert not any(report["installed"].values()), report["installed"]  # the client installed light
