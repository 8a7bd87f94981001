"""Transport security and caller authentication for every fastexp gRPC server and client.

- **TLS / mutual TLS** (:class:`ServerTLS`, :class:`ClientTLS`): PEM files named by operator settings. A server with
  a certificate serves TLS only; with ``client_ca_file`` it also requires a client certificate signed by that CA
  (mTLS). Clients verify the server against ``ca_file`` and present ``cert_file``/``key_file`` for mTLS.
- **Bearer tokens** (:class:`AuthInterceptor`): ``authorization: Bearer <token>`` metadata checked in constant time
  against the operator's token files (one token per line, e.g. a mounted Kubernetes Secret). Two privileges:
  ``call`` (every method) and ``admin`` (also ``UpdateWeights`` and the memory RPCs ``Sleep``, ``WakeUp``,
  ``OffloadModels``, ``ReloadModels``). No token files: authentication is off. gRPC
  health checking and reflection stay open, for probes and ``grpcurl``. A missing or unknown token gets
  UNAUTHENTICATED; a ``call`` token on an admin method gets PERMISSION_DENIED. Tokens are never logged: the
  interceptor's messages name the method, not the credential. Each admitted call runs as its caller's identity
  (:mod:`services.common.identity`: the SHA-256 of its token and whether it is an admin token), which handlers
  read to decide ownership. A service may name *run-scoped* methods: an admin method that a ``call`` token may
  call when the call names a run (request metadata :data:`RUN_ID_KEY`); the handler then decides, from the run's
  owner, what the caller may do (the experience service's ``UpdateWeights`` of a run).
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
import ipaddress
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from fastexp.security import AUTHORIZATION_KEY, SecurityConfigError, read_file
from fastexp.status import RUN_ID_KEY
from services.common.identity import Caller, caller_of, calling_as
from services.common.rpc import StreamBehavior, UnaryBehavior, WrappingInterceptor, method_parts, wrap_handler

logger = logging.getLogger(__name__)

#: Methods that need the ``admin`` privilege (full method names' last part).
ADMIN_METHODS = frozenset({"UpdateWeights", "Sleep", "WakeUp", "OffloadModels", "ReloadModels"})
#: Services anyone may call: health probes and reflection.
OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                           "grpc.reflection.v1.ServerReflection"})


def read_tokens(path: Path | str, setting: str) -> tuple[bytes, ...]:
    """The tokens in ``path``: one per line, blank lines and ``#`` comments ignored.

    Raises:
        SecurityConfigError: unreadable, or no token in it.
    """
    lines = (line.strip() for line in read_file(path, setting).splitlines())
    tokens = tuple(line for line in lines if line and not line.startswith(b"#"))
    if not tokens:
        raise SecurityConfigError(f"{setting}: {path} holds no token")
    return tokens


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only: ``localhost`` or a loopback address (``127.0.0.0/8``,
    ``::1``). Any other name, and the wildcards ``0.0.0.0`` and ``::``, count as exposed."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, *, secured: bool, insecure: bool, service: str) -> None:
    """Refuse to serve ``host`` beyond loopback with neither TLS nor tokens, unless the operator said
    ``insecure: true`` (then warn loudly): an open experience service hands anyone the policy's weights.

    Raises:
        SecurityConfigError: ``host`` is not loopback, ``secured`` is false and ``insecure`` is not set; the
            message names the settings that fix it.
    """
    if secured or is_loopback(host):
        return
    if not insecure:
        raise SecurityConfigError(
            f"host: {service} would serve {host} (beyond loopback) with neither TLS nor bearer tokens; set "
            "auth_tokens_file/admin_tokens_file or tls_cert_file/tls_key_file, bind host 127.0.0.1, or accept the "
            "risk with insecure: true"
        )
    logger.warning("INSECURE: %s serves %s without TLS and without tokens (insecure: true): anyone who can reach "
                   "it may call every method, UpdateWeights included", service, host)


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate chain and key (PEM), and the CA its clients' certificates must chain to (mTLS)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials; mTLS when ``client_ca_file`` is set.

        Raises:
            SecurityConfigError: a file is missing or empty.
        """
        key_pair = (read_file(self.key_file, "tls_key_file"), read_file(self.cert_file, "tls_cert_file"))
        if self.client_ca_file is None:
            return grpc.ssl_server_credentials([key_pair])
        return grpc.ssl_server_credentials(
            [key_pair], root_certificates=read_file(self.client_ca_file, "tls_client_ca_file"), require_client_auth=True
        )


class AuthInterceptor(WrappingInterceptor):
    """Checks every call's bearer token (module docs). ``call_tokens`` may call anything but the admin methods
    (``run_scoped`` ones too when the call names a run); ``admin_tokens`` may call everything. Admitted calls run
    as their :class:`~services.common.identity.Caller`."""

    def __init__(
        self, call_tokens: Sequence[bytes], admin_tokens: Sequence[bytes], run_scoped: frozenset[str] = frozenset()
    ) -> None:
        self._call_tokens = tuple(call_tokens)
        self._admin_tokens = tuple(admin_tokens)
        self._run_scoped = run_scoped

    def scoped_to_runs(self, methods: frozenset[str]) -> AuthInterceptor:
        """This interceptor with ``methods`` (admin methods) open to call tokens on calls that name a run: for a
        service whose handlers of those methods check the run's owner."""
        return AuthInterceptor(self._call_tokens, self._admin_tokens, self._run_scoped | methods)

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        service, method = method_parts(details)
        if service in OPEN_SERVICES:
            return handler
        token = _bearer_token(details.invocation_metadata)
        if token is None:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, f"{method} needs 'authorization: Bearer <token>'")
        admin = _known(token, self._admin_tokens)
        if not admin and not _known(token, self._call_tokens):
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, f"{method}: the bearer token is not valid here")
        if method in ADMIN_METHODS and not admin and not (
            method in self._run_scoped and _metadata_value(details.invocation_metadata, RUN_ID_KEY)
        ):
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, f"{method} needs an admin token")
        return _as_caller(handler, caller_of(token, admin=admin))


def _as_caller(handler: grpc.RpcMethodHandler, caller: Caller) -> grpc.RpcMethodHandler:
    """``handler`` run as ``caller`` (:func:`services.common.identity.calling_as`), every arity."""

    def unary(behavior: UnaryBehavior) -> UnaryBehavior:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            calling_as(caller)
            return await behavior(request, context)

        return run

    def stream(behavior: StreamBehavior) -> StreamBehavior:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            calling_as(caller)
            responses = behavior(request, context)
            if inspect.isawaitable(responses):  # a handler that writes with context.write()
                await responses
                return
            async with contextlib.aclosing(responses) as responses:  # a cancelled call closes the handler now
                async for response in responses:
                    yield response

        return run

    return wrap_handler(handler, unary=unary, stream=stream)


def _metadata_value(metadata: Sequence[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The first value of ``key`` in call metadata (None when absent or empty)."""
    for name, value in metadata or ():
        if name == key:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            return text or None
    return None


def _bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _known(token: bytes, tokens: Sequence[bytes]) -> bool:
    """Constant-time membership: every candidate is compared, whatever matches."""
    found = False
    for candidate in tokens:
        found |= hmac.compare_digest(token, candidate)
    return found


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s arity that rejects the call with ``code`` before the method runs."""

    async def reject(_request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def reject_stream(_request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(code, message)
        yield  # an async generator, as stream handlers are; abort() raises first

    return wrap_handler(handler, unary=lambda _behavior: reject, stream=lambda _behavior: reject_stream)
