"""The deployment files validate with the tools ops teams run: ``docker-compose config``, ``kubectl kustomize`` and
``kubernetes-validate`` (CI installs the first; the tests fail, not skip, when a tool is missing), and they agree
with the code: image targets exist, ports match the settings, the dashboard's series are the services' metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.common import metrics

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu-demo", "gpu")
K8S_VERSION = "1.30.0"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: .ci/run installs it (see README, Operations)")
    return path


def _kustomize(overlay: str) -> list[dict]:
    out = subprocess.run([_tool("kubectl"), "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
                         check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _dockerfile_stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = None
    for line in (ROOT / "deploy/docker/Dockerfile").read_text().splitlines():
        match = re.match(r"FROM \S+ AS (\S+)", line)
        if match:
            current = match[1]
            stages[current] = []
        elif current is not None:
            stages[current].append(line)
    return stages


def test_docker_compose_config_is_valid_and_builds_existing_targets():
    result = subprocess.run([_tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml"), "config"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert {"generator", "scorer", "experience", "reward-server", "prometheus"} <= set(config["services"])
    stages = _dockerfile_stages()
    for name, service in config["services"].items():
        if "build" in service:
            assert service["build"]["target"] in stages, name
            assert any("/cache" in str(v) for v in service["volumes"]), f"{name}: model cache volume"
            assert "healthcheck" in service, name
    experience = config["services"]["experience"]["environment"]
    assert json.loads(experience["FASTEXP_EXPERIENCE_GENERATOR_ADDRESSES"]) == ["dns:///generator:50051"]
    assert "ports" not in config["services"]["generator"], "a host port would stop `--scale generator=N`"
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for group in job.get("static_configs", ()) for t in group["targets"]}
    targets |= {f"{name}:{sd['port']}" for job in scrape["scrape_configs"] for sd in job.get("dns_sd_configs", ())
                for name in sd["names"]}
    for name in ("generator", "scorer", "experience"):
        port = config["services"][name]["environment"][f"FASTEXP_{name.upper()}_METRICS_PORT"]
        assert f"{name}:{port}" in targets


def test_every_service_image_runs_as_non_root_with_a_health_check():
    stages = _dockerfile_stages()
    for target in ("generator-cpu", "generator-cuda", "scorer", "experience", "experience-cuda", "reward-server"):
        body = "\n".join(stages[target])
        assert "USER fastexp" in body, target
        assert "HEALTHCHECK" in body, target
        assert "ENTRYPOINT" in body, target


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_overlays_build_and_validate_against_the_kubernetes_schema(overlay):
    documents = _kustomize(overlay)
    for document in documents:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents}
    for name in ("fastexp-generator", "fastexp-scorer", "fastexp-experience"):
        assert ("Deployment", name) in kinds and ("Service", name) in kinds and ("PodDisruptionBudget", name) in kinds
    assert {("HorizontalPodAutoscaler", "fastexp-scorer"), ("HorizontalPodAutoscaler", "fastexp-experience")} <= kinds
    assert any(kind == "ConfigMap" for kind, _ in kinds)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployments_probe_grpc_health_and_drain_before_they_are_killed(overlay):
    config_maps = [d for d in _kustomize(overlay) if d["kind"] == "ConfigMap"]
    settings = yaml.safe_load(config_maps[0]["data"]["fastexp.yaml"])
    for document in _kustomize(overlay):
        if document["kind"] == "Service":
            assert document["spec"]["clusterIP"] == "None"  # headless: client-side round_robin over pods
        if document["kind"] != "Deployment":
            continue
        spec = document["spec"]["template"]["spec"]
        container = spec["containers"][0]
        service = document["metadata"]["name"].removeprefix("fastexp-")
        grpc_port = settings[service]["port"]
        # readiness follows the dependencies (the overall "" status); liveness and start-up only that the process
        # serves ("liveness"), so a late or restarting generator never gets the experience pod restarted
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe not in container:
                continue
            health_service = "" if probe == "readinessProbe" else "liveness"
            if "grpc" in container[probe]:
                assert container[probe]["grpc"]["port"] == grpc_port
                assert container[probe]["grpc"].get("service", "") == health_service, (service, probe)
            else:  # with TLS, Kubernetes' gRPC probes cannot connect: `fastexp health` with the pod's certificate
                command = container[probe]["exec"]["command"]
                assert command[:3] == ["fastexp", "health", f"localhost:{grpc_port}"] and "--tls-ca-file" in command
                named = command[command.index("--service") + 1] if "--service" in command else ""
                assert named == health_service, (service, probe)
        assert spec["terminationGracePeriodSeconds"] > settings[service]["grace_period_s"] + 5  # preStop + drain
        assert document["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_gpu_overlay_turns_on_mtls_and_tokens_from_secrets():
    for document in _kustomize("gpu"):
        if document["kind"] != "Deployment":
            continue
        spec = document["spec"]["template"]["spec"]
        env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
        prefix = "FASTEXP_" + document["metadata"]["name"].removeprefix("fastexp-").upper()
        for field in ("TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CLIENT_CA_FILE", "AUTH_TOKENS_FILE", "ADMIN_TOKENS_FILE"):
            assert f"{prefix}_{field}" in env, (prefix, field)
        secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert secrets == {"fastexp-tls", "fastexp-tokens"}
        mounted = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert all(path.startswith(tuple(mounted)) for name, path in env.items() if name.endswith("_FILE"))
    assert not any("TLS" in str(d) for d in _kustomize("cpu-demo") if d["kind"] == "Deployment")


def test_gpu_overlay_gives_the_generator_a_gpu():
    generator = next(d for d in _kustomize("gpu") if d["kind"] == "Deployment" and d["metadata"]["name"] == "fastexp-generator")
    resources = generator["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert generator["spec"]["template"]["spec"]["containers"][0]["image"] == "fastexp/generator:cuda"


def test_dashboard_queries_only_series_the_services_export():
    exported = set()
    for value in vars(metrics).values():
        if hasattr(value, "_name") and hasattr(value, "_type"):
            name = value._name
            exported |= {name, f"{name}_total", f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    dashboard = json.loads((ROOT / "deploy/grafana/fastexp-dashboard.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"\bfastexp_[a-z_]+", target["expr"])}
    assert used and used <= exported, used - exported
