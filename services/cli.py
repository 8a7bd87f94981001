"""The ``fastexp`` command: ``serve generator|scorer|experience|reward-server|sandbox``, ``health``, ``up``, ``demo``,
``init-critic``.

Settings come from flags, then ``FASTEXP_<SERVICE>_<FIELD>`` environment variables, then a YAML file
(``--config``, one section per service), then defaults; they are validated once, here at the edge.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RLHF experiences over gRPC.")

ConfigOption = Annotated[Path | None, typer.Option("--config", exists=True, dir_okay=False, help="YAML settings")]
HostOption = Annotated[str | None, typer.Option(help="interface to bind")]
PortOption = Annotated[int | None, typer.Option(help="TCP port (0: any free port)")]


class Service(StrEnum):
    generator = "generator"
    scorer = "scorer"
    experience = "experience"
    reward_server = "reward-server"
    sandbox = "sandbox"


class Backend(StrEnum):
    auto = "auto"
    vllm = "vllm"
    hf = "hf"


def _logging(level: str, fmt: str = "text") -> None:
    from services.common.logs import configure_logging

    configure_logging(level, fmt)  # type: ignore[arg-type]


@app.command()
def serve(
    service: Annotated[Service, typer.Argument(help="which service to run")],
    config: ConfigOption = None,
    host: HostOption = None,
    port: PortOption = None,
    model: Annotated[str | None, typer.Option(help="generator: policy model folder or alias")] = None,
    backend: Annotated[Backend | None, typer.Option(help="generator: engine backend")] = None,
    generator_address: Annotated[str | None, typer.Option(help="experience: generator host:port")] = None,
    scorer_address: Annotated[str | None, typer.Option(help="experience: scorer host:port")] = None,
    critic_model: Annotated[str | None, typer.Option(help="experience: critic folder (fastexp init-critic)")] = None,
) -> None:
    """Run one service until SIGTERM/SIGINT.

    ``reward-server`` is the reference HTTP reward server (OpenRLHF protocol) over the ``reward_server:`` section's
    sources; ``sandbox`` the tool sandbox over HTTP (SandboxFusion's API; ``sandbox_server:`` section). A configuration naming something that does not exist exits with status 2 and lists every such name.
    """
    from pydantic import ValidationError

    from fastexp.security import SecurityConfigError
    from services.generator.server import ParallelismError
    from services.scorer.composition import ConfigError
    from services.scorer.sandbox import SandboxUnavailable

    common = {"host": host, "port": port}
    try:
        settings, run = _service_settings(
            service, config, common, model=model, backend=backend, generator_address=generator_address,
            scorer_address=scorer_address, critic_model=critic_model,
        )
    except ValidationError as error:
        typer.echo(f"invalid {service.value} settings:\n{error}", err=True)
        raise typer.Exit(2) from error
    _logging(settings.log_level, settings.log_format)
    try:
        _check_exposure(service, settings)
    except SecurityConfigError as error:
        typer.echo(f"{service.value} refuses to start: {error}", err=True)
        raise typer.Exit(2) from error
    if settings.metrics_port is not None:
        from services.common.metrics import start_metrics_server

        bound = start_metrics_server(settings.host, settings.metrics_port)
        logging.getLogger("fastexp").info("metrics on http://%s:%d/metrics", settings.host, bound)
    try:
        run(settings)
    except (ConfigError, SecurityConfigError, ParallelismError, SandboxUnavailable) as error:
        typer.echo(f"{service.value} refuses to start: {error}", err=True)
        raise typer.Exit(2) from error


def _check_exposure(service: Service, settings) -> None:
    """The gRPC services' safe default, checked before any model loads (``start_service`` checks it again).

    Raises:
        SecurityConfigError: as :func:`services.common.security.check_exposure`.
    """
    from services.common.security import check_exposure

    if service is not Service.reward_server:  # plain HTTP, no TLS or token settings of its own
        check_exposure(settings.host, secured=settings.secured(), insecure=settings.insecure, service=service.value)


def _service_settings(service, config, common, *, model, backend, generator_address, scorer_address, critic_model):
    from services.experience.settings import ExperienceSettings
    from services.generator.settings import GeneratorSettings
    from services.scorer.settings import RewardServerSettings, ScorerSettings

    if service is Service.generator:
        from services.generator.server import serve as run

        settings = GeneratorSettings.load(config, **common, model=model, backend=backend and backend.value)
    elif service is Service.scorer:
        from services.scorer.server import serve as run

        settings = ScorerSettings.load(config, **common)
    elif service is Service.reward_server:
        from services.scorer.http_server import serve as run

        settings = RewardServerSettings.load(config, **common)
    elif service is Service.sandbox:
        from services.scorer.sandbox.server import SandboxServerSettings
        from services.scorer.sandbox.server import serve as run

        settings = SandboxServerSettings.load(config, **common)
    else:
        from services.experience.server import serve as run

        settings = ExperienceSettings.load(
            config, **common, generator_address=generator_address, scorer_address=scorer_address,
            critic_model=critic_model,
        )
    return settings, run


@app.command()
def health(
    address: Annotated[str, typer.Argument(help="host:port of a fastexp gRPC service")],
    service: Annotated[str, typer.Option(help="service name to check ('' = the whole server)")] = "",
    timeout_s: Annotated[float, typer.Option(help="deadline of the check, seconds")] = 5.0,
    tls_ca_file: Annotated[Path | None, typer.Option(help="TLS: the CA of the server's certificate")] = None,
    tls_cert_file: Annotated[Path | None, typer.Option(help="mTLS: this client's certificate")] = None,
    tls_key_file: Annotated[Path | None, typer.Option(help="mTLS: this client's key")] = None,
    tls_server_name: Annotated[str | None, typer.Option(help="TLS: name to check in the certificate")] = None,
) -> None:
    """Exit 0 if ``address`` reports SERVING over the gRPC health protocol, else 1 (container health checks;
    health needs no token, TLS servers need ``--tls-ca-file``)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fastexp.security import ClientTLS

    if tls_ca_file is None:
        channel = grpc.insecure_channel(address)
    else:
        tls = ClientTLS(tls_ca_file, tls_cert_file, tls_key_file, tls_server_name)
        channel = grpc.secure_channel(address, tls.credentials(), options=tls.options())
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as error:
            typer.echo(f"{address}: {error.code().name} {error.details()}", err=True)
            raise typer.Exit(1) from error
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    typer.echo(f"{address}: {status}")
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise typer.Exit(1)


@app.command()
def up(
    config: ConfigOption = None,
    backend: Annotated[Backend, typer.Option(help="generator engine backend")] = Backend.auto,
    base_port: Annotated[int, typer.Option(help="generator port; scorer +1, experience +2, more replicas +3, ...")] = 50051,
    generator_replicas: Annotated[int, typer.Option(min=1, help="generator replicas (a fleet; each its own port)")] = 1,
) -> None:
    """Run generator(s), scorer and experience as local processes until Ctrl-C."""
    import signal

    from services.launcher import SERVICES, LocalCluster

    _logging("INFO")
    ports = {name: base_port + i for i, name in enumerate(SERVICES)}
    ports |= {f"generator-{i}": base_port + 2 + i for i in range(1, generator_replicas)}
    overrides = {"generator": {"backend": backend.value}}
    with LocalCluster(ports=ports, config_file=config, overrides=overrides, generator_replicas=generator_replicas) as c:
        typer.echo(f"experience service ready at {c.address('experience')} (Ctrl-C stops)")
        # Blocked only now, after the children were started, so they keep their default signal handling.
        stop_signals = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        received = signal.sigwait(stop_signals)
        typer.echo(f"{signal.Signals(received).name}: stopping the services")


@app.command()
def demo(
    num_prompts: Annotated[int, typer.Option(min=1, help="prompts (reasoning-gym problems)")] = 16,
    n_samples_per_prompt: Annotated[int, typer.Option(min=2, help="samples per prompt")] = 4,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 256,
    task: Annotated[str, typer.Option(
        help="basic_arithmetic (2 one-digit terms), basic_arithmetic_2digit, gsm_symbolic, or any reasoning-gym task"
    )] = "basic_arithmetic",
    advantage_estimator: Annotated[str, typer.Option(help="group_norm, rloo, reinforce, ...")] = "group_norm",
    backend: Annotated[Backend, typer.Option(help="generator engine backend")] = Backend.auto,
    model: Annotated[str, typer.Option(help="policy/reference model folder or alias")] = "smollm2-135m-instruct",
    out: Annotated[Path, typer.Option(help="output folder")] = Path("out/demo"),
    seed: Annotated[int, typer.Option(help="problem-generation seed")] = 0,
) -> None:
    """Start the three services on the embedded default and stream real experiences (see README)."""
    from services.demo.job import DemoOptions, run_demo

    _logging("INFO")
    run_demo(
        DemoOptions(
            num_prompts=num_prompts, n_samples_per_prompt=n_samples_per_prompt, max_new_tokens=max_new_tokens,
            task=task, advantage_estimator=advantage_estimator, backend=backend.value, model=model, out=out,
            seed=seed,
        )
    )


@app.command("init-critic")
def init_critic(
    out: Annotated[Path, typer.Argument(help="critic folder to write")],
    model: Annotated[str, typer.Option(help="causal LM or reward model folder (or alias) for the backbone")] = (
        "smollm2-135m-instruct"
    ),
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32")] = "bfloat16",
) -> None:
    """Write a first critic: MODEL's backbone with a zero value head (values start at 0), for --critic-model."""
    from services.common.models import resolve_model
    from services.experience.workers.critic import init_critic as make_critic

    _logging("INFO")
    typer.echo(make_critic(resolve_model(model), out, dtype=dtype))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
