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
from services.experience.runs.metrics import RUN_METRICS

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
    assert {"generator", "scorer", "experience", "reward-server", "sandbox", "prometheus"} <= set(config["services"])
    stages = _dockerfile_stages()
    for name, service in config["services"].items():
        if "build" in service:
            assert service["build"]["target"] in stages, name
            assert "healthcheck" in service, name
            if name != "sandbox":  # the tool sandbox gets no volume at all
                assert any("/cache" in str(v) for v in service["volumes"]), f"{name}: model cache volume"
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
    for target in ("generator-cpu", "generator-cuda", "scorer", "experience", "experience-cuda", "reward-server",
                   "sandbox"):
        body = "\n".join(stages[target])
        assert "USER fastexp" in body, target
        assert "HEALTHCHECK" in body, target
        assert "ENTRYPOINT" in body, target
    for target in ("scorer", "sandbox"):  # the tool sandbox's backend and its system-call filter's library
        assert "bubblewrap=" in "\n".join(stages[target]) and "libseccomp2=" in "\n".join(stages[target]), target


def _compose() -> dict:
    out = subprocess.run([_tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml"), "config"],
                         check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return yaml.safe_load(out)


def _secret_names(service: dict) -> set[str]:
    return {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}


def test_compose_runs_tool_code_in_a_sandbox_container_with_nothing_to_take():
    config = _compose()
    sandbox, scorer = config["services"]["sandbox"], config["services"]["scorer"]
    assert "volumes" not in sandbox and "ports" not in sandbox
    assert _secret_names(sandbox) == {"sandbox-token"}
    assert set(sandbox["networks"]) == {"sandbox"} and config["networks"]["sandbox"]["internal"] is True
    assert {name for name, service in config["services"].items() if "sandbox" in service.get("networks", {})} == {
        "sandbox", "scorer"}
    assert sandbox["read_only"] is True and sandbox["cap_drop"] == ["ALL"]
    options = {o.replace(":", "=", 1) for o in sandbox["security_opt"]}  # docker-compose writes seccomp:<file>
    assert "seccomp=./deploy/seccomp/fastexp-sandbox.json" in options  # a profile of its own, not unconfined
    assert "no-new-privileges:true" in sandbox["security_opt"]
    assert sandbox["environment"]["FASTEXP_SANDBOX_SERVER_AUTH_TOKENS_FILE"] == "/run/secrets/sandbox-token"
    assert scorer["environment"]["FASTEXP_SCORER_SANDBOX__BACKEND"] == "remote"
    assert scorer["environment"]["FASTEXP_SCORER_SANDBOX__REMOTE_URL"] == "http://sandbox:8080"
    assert "security_opt" not in scorer  # the scorer keeps Docker's default profiles


def test_compose_ships_with_tokens_on_and_each_service_mounts_only_its_secrets():
    services = _compose()["services"]
    expected = {"generator": {"admin-tokens"}, "scorer": {"admin-tokens", "sandbox-token"},
                "experience": {"call-tokens", "admin-tokens", "upstream-token", "state-db-password"}}
    for name, secrets in expected.items():
        assert _secret_names(services[name]) == secrets, name
        files = {v for k, v in services[name]["environment"].items()
                 if k.endswith(("TOKENS_FILE", "TOKEN_FILE", "PASSWORD_FILE"))}
        assert files == {f"/run/secrets/{secret}" for secret in secrets}, name
    script = (ROOT / "deploy/make-secrets.sh").read_text()
    assert all(f"secrets/{name}" in script for name in ("call-tokens", "admin-tokens", "upstream-token",
                                                         "sandbox-token", "state-db-password"))


def test_compose_gives_the_experience_service_a_shared_state_store_and_weights_volume():
    config = _compose()
    experience, postgres = config["services"]["experience"], config["services"]["postgres"]
    environment = experience["environment"]
    assert environment["FASTEXP_EXPERIENCE_STATE_URL"].startswith("postgresql://fastexp@postgres:5432/")
    assert environment["FASTEXP_EXPERIENCE_STATE_PASSWORD_FILE"] == "/run/secrets/state-db-password"
    assert any(str(v).startswith("experience-weights:/weights") or (isinstance(v, dict) and v.get("target") == "/weights")
               for v in experience["volumes"]) and environment["FASTEXP_EXPERIENCE_WEIGHTS_DIR"] == "/weights"
    assert "ports" not in postgres, "the state store is not published on the host"
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/state-db-password"
    assert {"experience-state", "experience-weights"} <= set(config["volumes"])


def test_compose_lets_a_stopping_experience_replica_hand_its_streams_over():
    # docker-compose config writes stop_grace_period in seconds or as "1m15s"; the drain must end before the kill
    experience = _compose()["services"]["experience"]
    environment = experience["environment"]
    grace, margin = float(environment["FASTEXP_EXPERIENCE_GRACE_PERIOD_S"]), float(environment["FASTEXP_EXPERIENCE_DRAIN_MARGIN_S"])
    stop = experience["stop_grace_period"]
    stop_s = float(stop) if isinstance(stop, int | float) or str(stop).isdigit() else _seconds(str(stop))
    assert 0 < margin < grace < stop_s


def _seconds(duration: str) -> float:
    """``1m15s``, ``75s``, ``1m`` as seconds."""
    import re

    parts = dict((unit, float(value)) for value, unit in re.findall(r"([\d.]+)(h|m|s)", duration))
    return parts.get("h", 0) * 3600 + parts.get("m", 0) * 60 + parts.get("s", 0)


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
        if service == "sandbox":  # HTTP, checked by test_the_sandbox_pod_holds_nothing_and_reaches_nothing
            continue
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
        if service == "experience":  # streams still open drain_margin_s before the grace ends are handed over
            assert 0 < settings[service]["drain_margin_s"] < settings[service]["grace_period_s"]
        assert document["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert spec["securityContext"]["runAsNonRoot"] is True


GRPC_SERVICES = ("generator", "scorer", "experience")
#: The token Secret keys each pod mounts (items:), nothing more.
TOKEN_ITEMS = {"generator": {"admin-tokens"}, "scorer": {"admin-tokens"},
               "experience": {"call-tokens", "admin-tokens", "upstream-token"}}


def _deployments(overlay: str) -> dict[str, dict]:
    return {d["metadata"]["name"].removeprefix("fastexp-"): d["spec"]["template"]["spec"]
            for d in _kustomize(overlay) if d["kind"] == "Deployment"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tokens_are_on_and_each_pod_mounts_only_its_own_secret_keys(overlay):
    for service, spec in _deployments(overlay).items():
        secret_volumes = [v["secret"] for v in spec["volumes"] if "secret" in v]
        for secret in secret_volumes:
            assert secret.get("items"), (service, secret["secretName"], "mounts every key")
        tokens = [s for s in secret_volumes if s["secretName"] == "fastexp-tokens"]
        if service == "sandbox":
            assert tokens == [] and {s["secretName"] for s in secret_volumes} == {"fastexp-sandbox-token"}
            continue
        assert {item["key"] for item in tokens[0]["items"]} == TOKEN_ITEMS[service], service
        env = {e["name"]: e.get("value", "") for e in spec["containers"][0]["env"]}
        assert f"FASTEXP_{service.upper()}_ADMIN_TOKENS_FILE" in env, service
        mounted = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert all(path.startswith(tuple(mounted)) for name, path in env.items() if name.endswith("_FILE"))


def test_gpu_overlay_turns_on_mtls_with_a_certificate_per_service():
    deployments = _deployments("gpu")
    for service in GRPC_SERVICES:
        spec = deployments[service]
        env = {e["name"]: e.get("value", "") for e in spec["containers"][0]["env"]}
        for field in ("TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CLIENT_CA_FILE"):
            assert f"FASTEXP_{service.upper()}_{field}" in env, (service, field)
        tls = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v} - {
            "fastexp-tokens", "fastexp-sandbox-token"}
        assert tls == {f"fastexp-{service}-tls"}, service
    assert not any("TLS" in str(d) for d in _kustomize("cpu-demo") if d["kind"] == "Deployment")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_sandbox_pod_holds_nothing_and_reaches_nothing(overlay):
    documents = _kustomize(overlay)
    spec = _deployments(overlay)["sandbox"]
    container = spec["containers"][0]
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {  # the runs' deny list less what bubblewrap needs
        "type": "Localhost", "localhostProfile": "fastexp/sandbox.json"}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert {v["name"] for v in spec["volumes"]} == {"token", "tmp"}
    scorer_env = {e["name"]: e.get("value", "") for e in _deployments(overlay)["scorer"]["containers"][0]["env"]}
    assert scorer_env["FASTEXP_SCORER_SANDBOX__BACKEND"] == "remote"
    assert "seccompProfile" not in _deployments(overlay)["scorer"]["securityContext"]
    policies = {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "NetworkPolicy"}
    sandbox = policies["fastexp-sandbox"]
    assert "Egress" in sandbox["policyTypes"] and sandbox["egress"] == []
    assert sandbox["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fastexp-scorer"}}}]
    for upstream, port in (("generator", 50051), ("scorer", 50052)):
        rules = policies[f"fastexp-{upstream}"]["ingress"]
        reach = [rule["from"] for rule in rules if {"port": port} in rule["ports"]]
        assert reach == [[{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fastexp-experience"}}}]]


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
    exported |= {family.name for family in RUN_METRICS.collect()}  # read at scrape time (per-run gauges)
    dashboard = json.loads((ROOT / "deploy/grafana/fastexp-dashboard.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"\bfastexp_[a-z_]+", target["expr"])}
    assert used and used <= exported, used - exported


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_experience_replicas_share_a_state_store_by_url_and_a_weights_volume(overlay):
    documents = _kustomize(overlay)
    deployment = next(d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"] == "fastexp-experience")
    spec = deployment["spec"]["template"]["spec"]
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["FASTEXP_EXPERIENCE_STATE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "fastexp-state", "key": "url"}
    assert env["FASTEXP_EXPERIENCE_WEIGHTS_DIR"]["value"] == "/weights"
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert claims == {"weights": "fastexp-experience-weights"} and mounts["weights"] == "/weights"
    claim = next(d for d in documents if d["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == (["ReadWriteOnce"] if overlay == "cpu-demo" else ["ReadWriteMany"])
    autoscaler = next(d for d in documents if d["kind"] == "HorizontalPodAutoscaler"
                      and d["metadata"]["name"] == "fastexp-experience")
    assert autoscaler["spec"]["maxReplicas"] >= 2  # more than one replica for real
    statefulsets = [d for d in documents if d["kind"] == "StatefulSet"]
    if overlay == "cpu-demo":  # its own PostgreSQL, reachable from the experience pods alone
        assert [d["metadata"]["name"] for d in statefulsets] == ["fastexp-postgres"]
        policy = next(d for d in documents if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "fastexp-postgres")
        assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {
            "app.kubernetes.io/name": "fastexp-experience"}
    else:  # production: an external database by URL
        assert statefulsets == []


def test_compose_publishes_only_authenticated_services_beyond_the_hosts_loopback():
    # gRPC services with bearer tokens may be published; Prometheus (no authentication) and the reward server
    # (tokens too, but an HTTP demo) only on the host's loopback; the state store and the sandbox not at all
    services = _compose()["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            published = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}"
            if name in ("prometheus", "reward-server"):
                assert published.startswith("127.0.0.1:"), (name, port)
            else:
                assert name in ("experience", "scorer"), (name, port)
    assert services["reward-server"]["environment"]["FASTEXP_REWARD_SERVER_AUTH_TOKENS_FILE"] == "/run/secrets/call-tokens"
