"""Transport security and credentials of a client (trainers' SDK, and the experience service's own calls).

TLS / mutual TLS from PEM files (:class:`ClientTLS`) and the ``authorization: Bearer <token>`` metadata; the
server half (certificates, token checks) is :mod:`services.common.security`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

AUTHORIZATION_KEY = "authorization"


class SecurityConfigError(ValueError):
    """A TLS or token file is missing, empty or unreadable (raised at start-up, naming the setting)."""


def read_file(path: Path | str, setting: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise SecurityConfigError(f"{setting}: cannot read {path}: {error.strerror}") from error
    if not data.strip():
        raise SecurityConfigError(f"{setting}: {path} is empty")
    return data


@dataclass(frozen=True)
class ClientTLS:
    """What a client needs for TLS: the CA that signed the server's certificate, and its own certificate and key
    for mTLS (both or neither). ``server_name`` overrides the name checked against the certificate."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials.

        Raises:
            SecurityConfigError: a file is missing or empty, or only one of cert/key is given.
        """
        if (self.cert_file is None) != (self.key_file is None):
            raise SecurityConfigError("a client certificate needs both cert_file and key_file")
        return grpc.ssl_channel_credentials(
            root_certificates=read_file(self.ca_file, "ca_file"),
            private_key=None if self.key_file is None else read_file(self.key_file, "key_file"),
            certificate_chain=None if self.cert_file is None else read_file(self.cert_file, "cert_file"),
        )

    def options(self) -> list[tuple[str, str]]:
        """Channel options (the certificate name override, when set)."""
        return [] if self.server_name is None else [("grpc.ssl_target_name_override", self.server_name)]


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The ``authorization`` metadata for ``token`` (none for ``None``)."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),) if token else ()
