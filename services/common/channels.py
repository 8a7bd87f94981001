"""Channels the services open to each other (the experience service to its generators and scorer, a scorer's
judge to a generator fleet): fastexp's message limits, round-robin over a name's replicas, TLS and the one client
interceptor (:class:`fastexp.channels.ClientEdge`: bearer token, the bound request id, domain errors)."""

from __future__ import annotations

import grpc

from fastexp.channels import ClientEdge, channel_options
from fastexp.security import ClientTLS
from services.common.logs import current_request_id


def open_channel(
    address: str, max_message_bytes: int, tls: ClientTLS | None = None, token: str | None = None,
    load_balancing: str = "round_robin",
) -> grpc.aio.Channel:
    """A channel with fastexp's message limits and the ``round_robin`` policy: behind a name that resolves to
    several replicas (``dns:///fastexp-scorer:50052``, a Kubernetes headless Service) calls spread over every
    ready one instead of pinning one connection; a peer that went away is tried again at least every 2 s
    (``RECONNECT_BACKOFF_OPTIONS``). ``tls``: verify the server (and present a client certificate);
    ``token``: send ``authorization: Bearer`` on every call. ``load_balancing="pick_first"`` keeps every call on
    one replica instead (stateful calls: an environment session lives in the scorer process that opened it).

    Raises:
        fastexp.security.SecurityConfigError: a TLS file is missing or empty.
    """
    options = [*channel_options(max_message_bytes), ("grpc.lb_policy_name", load_balancing)]
    interceptors = ClientEdge(token, request_id=current_request_id).for_aio()  # token, request id, domain errors
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address, tls.credentials(), options=[*options, *tls.options()], interceptors=interceptors
    )
