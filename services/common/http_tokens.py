"""The bearer tokens an HTTP edge that is a service of its own accepts (the sandbox server, the reference reward
server): call and admin tokens alike, as the gRPC services accept both for every call but UpdateWeights. Apart
from :mod:`services.common.http_edge` because it loads the gRPC security module, which the gateway's serving
must not."""

from __future__ import annotations

from services.common.security import SecurityConfigError, read_tokens
from services.common.settings import ServiceSettings


def edge_tokens(settings: ServiceSettings) -> tuple[bytes, ...]:
    """The bearer tokens an edge accepts: those of ``auth_tokens_file`` and ``admin_tokens_file`` together; empty
    only when neither file is set (a file that is set holds at least one token, or this raises).

    Raises:
        SecurityConfigError: a token file that is set is unreadable or holds no token.
    """
    tokens = [*(read_tokens(settings.auth_tokens_file, "auth_tokens_file") if settings.auth_tokens_file else ()),
              *(read_tokens(settings.admin_tokens_file, "admin_tokens_file") if settings.admin_tokens_file else ())]
    if not tokens and (settings.auth_tokens_file or settings.admin_tokens_file):  # an edge must not run open
        raise SecurityConfigError("auth_tokens_file / admin_tokens_file: set, but no token was read")
    return tuple(tokens)
