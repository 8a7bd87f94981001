"""TLS of the scorer's HTTP calls (remote reward models, a remote sandbox): which CA verifies the endpoint, and the
scorer's own certificate where the endpoint asks for one (mutual TLS: an HTTP edge with ``tls_client_ca_file``)."""

from __future__ import annotations

import ssl
from pathlib import Path

from fastexp.security import SecurityConfigError, read_file


def client_tls(ca_file: Path | None, cert_file: Path | None, key_file: Path | None,
               prefix: str) -> ssl.SSLContext | bool:
    """httpx's ``verify``: True (the system's CAs, no client certificate) when no file is set; else a context
    verifying with ``ca_file`` (the system's CAs without it) and presenting ``cert_file``/``key_file`` (PEM, both
    or neither). ``prefix``: the settings' names in errors (e.g. ``sandbox.remote_``).

    Raises:
        SecurityConfigError: a file is unreadable or empty, or a certificate comes without its key (or a key
            without its certificate), naming the setting.
    """
    if (cert_file is None) != (key_file is None):
        raise SecurityConfigError(f"{prefix}cert_file and {prefix}key_file: both or neither (mutual TLS)")
    if ca_file is None and cert_file is None:
        return True
    context = ssl.create_default_context(
        cadata=None if ca_file is None else read_file(ca_file, f"{prefix}ca_file").decode())
    if cert_file is not None and key_file is not None:
        read_file(cert_file, f"{prefix}cert_file")
        read_file(key_file, f"{prefix}key_file")
        context.load_cert_chain(str(cert_file), str(key_file))
    return context
