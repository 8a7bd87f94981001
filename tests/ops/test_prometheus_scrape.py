"""A real Prometheus (Debian's ``prometheus``) scrapes the three services while a MakeExperiences stream runs,
and the series ops teams watch appear: calls by status, stage latencies, tokens, queue depths, policy version,
reward and KL distributions."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import httpx
import pytest

from fastexp import ExperienceClient, Sampling
from services.demo.datasets import reasoning_gym_problems
from services.launcher import SERVICES, LocalCluster, free_port

pytestmark = [pytest.mark.smollm2]


@pytest.fixture(scope="module")
def prometheus_and_cluster(tmp_path_factory, smollm2_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: .ci/run installs Debian's prometheus (README, Operations)")
    root = tmp_path_factory.mktemp("prometheus")
    metrics_ports = {name: free_port() for name in SERVICES}
    scrape = "\n".join(
        f"  - job_name: fastexp-{name}\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]"
        for name, port in metrics_ports.items()
    )
    (root / "prometheus.yml").write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n{scrape}\n")
    web_port = free_port()
    prometheus = subprocess.Popen(
        [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
         f"--web.listen-address=127.0.0.1:{web_port}"],
        stdout=(root / "prometheus.log").open("wb"), stderr=subprocess.STDOUT,
    )
    logs = {"log_format": "json", "log_level": "DEBUG"}
    overrides = {
        "generator": {"model": smollm2_path, "backend": "hf", "metrics_port": metrics_ports["generator"], **logs},
        "scorer": {"metrics_port": metrics_ports["scorer"], **logs},
        "experience": {"actor_model": smollm2_path, "reference_model": smollm2_path, "torch_threads": 1,
                       "metrics_port": metrics_ports["experience"], **logs},
    }
    try:
        with LocalCluster(overrides=overrides, log_dir=root / "logs") as cluster:
            yield f"http://127.0.0.1:{web_port}", cluster
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)


REQUEST_ID = "trainer-run-7-step-3"


def _query(base: str, expr: str) -> list[dict]:
    reply = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5)
    reply.raise_for_status()
    return reply.json()["data"]["result"]


def _eventually(base: str, expr: str, timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = _query(base, expr)
        except httpx.HTTPError:
            result = []
        if result or time.monotonic() > deadline:
            return result
        time.sleep(1)


def test_series_appear_after_a_make_experiences_call(prometheus_and_cluster):
    base, cluster = prometheus_and_cluster
    problems = reasoning_gym_problems("basic_arithmetic", 2, seed=0)
    with ExperienceClient(cluster.address("experience"), timeout_s=600) as client:
        batches = list(client.make_experiences(
            [list(p.messages) for p in problems], references=[p.reference for p in problems],
            n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=16), request_id=REQUEST_ID,
        ))
    assert sum(len(e.reward) for e in batches) == 4

    assert len(_eventually(base, 'up{job=~"fastexp-.*"} == 1')) == 3
    samples = _eventually(base, "fastexp_experience_samples_total >= 4")
    assert samples, "experience samples streamed"
    ok = _eventually(base, 'fastexp_grpc_server_handled_total{grpc_method="MakeExperiences", grpc_code="OK"} >= 1')
    assert ok and ok[0]["metric"]["job"] == "fastexp-experience"
    assert _eventually(base, 'fastexp_grpc_server_handled_total{job="fastexp-generator", grpc_method="Generate"}')
    assert _eventually(base, 'fastexp_grpc_server_handled_total{job="fastexp-scorer", grpc_method="Score"}')
    assert _eventually(base, "fastexp_generated_tokens_total > 0")
    stages = {r["metric"]["stage"] for r in _eventually(base, "fastexp_stage_duration_seconds_count > 0")}
    assert {"generate", "score", "actor", "reference", "advantages", "stream"} <= stages
    assert _eventually(base, "fastexp_reward_count >= 4") and _eventually(base, "fastexp_kl_nats_count >= 4")
    assert _eventually(base, 'fastexp_queue_depth{queue="scored"}')
    assert {r["metric"]["job"] for r in _eventually(base, "fastexp_policy_version")} >= {
        "fastexp-generator", "fastexp-experience"}
    assert _eventually(base, 'fastexp_reward_source_duration_seconds_count{job="fastexp-scorer"} > 0')


def test_one_request_id_follows_the_stream_through_every_services_json_logs(prometheus_and_cluster):
    """Runs after the stream above: its request id is on the generator's and the scorer's log records too."""
    _, cluster = prometheus_and_cluster
    for name in ("generator", "scorer"):
        records = [json.loads(line) for line in (cluster.log_dir / f"{name}.log").read_text().splitlines()
                   if line.startswith("{")]
        assert records and all({"asctime", "level", "logger", "message", "request_id"} <= r.keys() for r in records)
        assert any(r["request_id"] == REQUEST_ID for r in records), name
