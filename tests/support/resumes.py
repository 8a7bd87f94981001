"""What resumed streams cost, read from a :class:`~services.launcher.LocalCluster`'s experience replicas (the chaos
suite and ``benchmarks/resume.py``): which replica a proxy sent the stream to, and how many prompt groups the
resumed opens generated (each resume logs ``resumed (open N): <held> groups held, <n> to generate``; a killed
replica's metrics die with it, its log does not)."""

from __future__ import annotations

from collections.abc import Sequence

from services.launcher import LocalCluster
from tests.support.proxies import TcpProxy


def serving_replica(cluster: LocalCluster, proxy: TcpProxy, names: Sequence[str]) -> str:
    """The replica of ``names`` the proxy sent its last connection to."""
    return next(name for name in names if cluster.address(name) == proxy.routed[-1])


def groups_regenerated(cluster: LocalCluster, names: Sequence[str]) -> int:
    """Prompt groups the resumed opens on replicas ``names`` generated, from their logs."""
    total = 0
    for name in names:
        for line in cluster.log_path(name).read_text(errors="replace").splitlines():
            if " resumed (open " in line:
                total += int(line.rsplit(" held, ", 1)[1].split(" to generate")[0])
    return total
