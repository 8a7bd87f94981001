"""Where the generator replicas are: the fleet's targets resolved to replica addresses, ``host:port`` as given or
``dns:///name:port`` as every address the name resolves to (a Kubernetes headless service's pods), resolved again
every ``discovery_interval_s`` by :class:`~services.experience.fleet.replicas.ReplicaSet`."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

DNS_SCHEME = "dns:///"


async def resolve_targets(targets: Sequence[str]) -> list[str]:
    """The replica addresses of ``targets``: ``host:port`` as given; ``dns:///name:port`` as every address the name
    resolves to (``ip:port``, ``[ipv6]:port``), sorted.

    Raises:
        OSError: a ``dns:///`` name did not resolve (``socket.gaierror``).
        ValueError: a target without a port.
    """
    loop = asyncio.get_running_loop()
    addresses: set[str] = set()
    for target in targets:
        if not target.startswith(DNS_SCHEME):
            addresses.add(target)
            continue
        host, sep, port = target.removeprefix(DNS_SCHEME).rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{target!r}: expected dns:///name:port")
        infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        for family, _, _, _, sockaddr in infos:
            ip = sockaddr[0]
            addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)
