"""Attacks of the sixth independent review of the tool sandbox (2026-11-26), each through a real ``bwrap`` run:
kernel memory queued where no count looked (multipath TCP and netlink sockets, TCP and unix connections waiting in
listen queues), and a run that made the scorer spend CPU reading its mappings. Each test failed before its fix. The
review's channels through kernel-wide counters (socket cookies, ``/proc/net/softnet_stat``) are residuals stated in
docs/operations/security.md.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from services.scorer.sandbox.base import SandboxLimits
from services.scorer.sandbox.bubblewrap import BubblewrapSandbox

pytestmark = pytest.mark.skipif(not Path("/usr/bin/bwrap").exists(), reason="needs bubblewrap")


#: Limits of the runs that queue kernel memory and then hold it (their sleeps keep it held while the run is sampled).
QUEUE_LIMITS = SandboxLimits(timeout_s=60.0, cpu_s=30, memory_bytes=96 * 1024 * 1024)


async def _run_holding_queues(code: str):
    """``code`` (indented as in a test) run under :data:`QUEUE_LIMITS` on real bubblewrap; its result."""
    return await BubblewrapSandbox().run(textwrap.dedent(code), QUEUE_LIMITS)


async def test_netlink_and_multipath_tcp_sockets_are_refused_loopback_tcp_still_works():
    # the review queued 1.5 GB on MPTCP sockets (no /proc/net/tcp row shows them) and 316 MiB on netlink ones
    code = """
        import errno, socket
        for family, kind, protocol in ((socket.AF_NETLINK, socket.SOCK_RAW, 2), (socket.AF_INET, socket.SOCK_STREAM, 262),
                                       (socket.AF_INET6, socket.SOCK_STREAM, 262)):
            try:
                socket.socket(family, kind, protocol)
                print("opened", family, protocol)
            except OSError as error:
                print(errno.errorcode[error.errno])
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        client.sendall(b"ping")
        print(server.recv(4).decode())
    """
    result = await BubblewrapSandbox().run(textwrap.dedent(code), SandboxLimits(timeout_s=30.0))
    assert result.stdout.split() == ["EAFNOSUPPORT", "EPROTONOSUPPORT", "EPROTONOSUPPORT", "ping"], result


async def test_connections_waiting_in_listen_queues_count_against_the_runs_memory():
    # the review left 148,000 connections unaccepted (~600 MB of kernel memory, no descriptor, no queued byte) and
    # the scorer counted 12 MB; each socket now counts SOCKET_BYTES
    code = """
        import socket
        listeners = []
        for host in range(1, 9):
            listener = socket.socket()
            listener.bind((f"127.0.0.{host}", 5000))
            listener.listen(4096)
            listeners.append(listener)
        made = 0
        for listener in listeners:
            for _ in range(4000):
                client = socket.socket()
                client.connect(listener.getsockname())
                client.close()
                made += 1
        print("all made", made, flush=True)
        import time
        time.sleep(30)
    """
    result = await _run_holding_queues(code)
    # stopped within a sample of passing the limit (before: asleep until its timeout); on a loaded host the read of
    # 32,000 rows may pass the sample's time bound first, which stops the run as well
    assert result.stopped in ("memory", "usage"), result


async def test_unix_connections_waiting_in_listen_queues_count_against_the_runs_memory():
    # the re-run of the review sent 1.2 GB into 19,000 unix connections nobody accepted, their senders closed (no
    # descriptor, no queue column anywhere); each unix socket now counts what its send buffer may hold
    code = """
        import os, socket, time
        listeners = []
        for index in range(20):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(f"/tmp/l{index}")
            listener.listen(4096)
            listeners.append(listener)
        for listener in listeners:
            for _ in range(100):
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                client.connect(listener.getsockname())
                client.sendall(bytes(65536))
                client.close()
        print("all sent", flush=True)
        time.sleep(30)
    """
    result = await _run_holding_queues(code)
    assert result.stopped in ("memory", "usage"), result  # before: it slept 30 s and ended unstopped


async def test_unix_datagrams_queued_for_a_receiver_count_against_the_runs_memory():
    # the final review of the fix: a datagram receiver holds up to max_dgram_qlen + 1 datagrams of a send buffer each,
    # from senders that closed since (11 x 208 KB against the 416 KiB a stream socket counts)
    code = """
        import socket, time
        receivers = []
        for index in range(60):
            receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            receiver.bind(f"/tmp/r{index}")
            receivers.append(receiver)
            for _ in range(11):
                sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sender.setblocking(False)
                try:
                    sender.sendto(bytes(200_000), f"/tmp/r{index}")
                except BlockingIOError:
                    pass
                sender.close()
        print("all sent", flush=True)
        time.sleep(30)
    """
    result = await _run_holding_queues(code)
    assert result.stopped in ("memory", "usage"), result  # before: it slept 30 s and ended unstopped


async def test_the_scorers_cpu_reading_a_runs_mappings_counts_toward_its_cpu_seconds():
    # the review's run spent 0.06 CPU-s while the scorer spent 7 reading its 45,000 mappings of a file under a
    # 3 KB path, sample after sample; that reading now counts toward the run's cpu_s
    code = """
        import ctypes, os, time
        folder = "/tmp/" + "/".join(["d" * 250] * 12)
        os.makedirs(folder)
        path = folder + "/" + "f" * 250
        with open(path, "wb") as file:
            file.write(bytes(4096))
        for _ in range(15):
            if os.fork() == 0:
                libc = ctypes.CDLL(None)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_long]
                fd = os.open(path, os.O_RDONLY)
                for _ in range(3000):
                    libc.mmap(None, 4096, 1, 2, fd, 0)  # PROT_READ, MAP_PRIVATE
                time.sleep(3600)
        print("all mapped", flush=True)
        time.sleep(3600)
    """
    result = await BubblewrapSandbox().run(textwrap.dedent(code), SandboxLimits(timeout_s=60.0, cpu_s=2))
    # stopped within seconds (before: at its 60 s timeout); on a loaded host one sample of these mappings may pass
    # the sample's 0.5 s bound before the charged CPU passes cpu_s, which stops the run as well
    assert result.stopped in ("cpu", "usage"), result
