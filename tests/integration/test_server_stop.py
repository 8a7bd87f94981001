"""A service process's stop has a limit, on a real process and real signals: a server whose cleanup never ends
(a stuck call or close) exits with status 1 once its grace period and stop margin have passed, its log saying
where it was stuck (the stuck coroutine, innermost); ``kill -USR1`` logs every task's and thread's stack while it
serves; the handlers are in before the service starts, so a signal its first line invites is never fatal, and
SIGTERM while starting ends the start. Events, not sleeps: the test waits for the process's own lines."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SERVICE = textwrap.dedent("""
    import asyncio, logging, sys
    from services.common.server import create_server, run_service

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    async def cleanup_that_never_ends():
        await asyncio.Event().wait()

    async def start():
        running = await create_server(host="127.0.0.1", port=0, register=lambda server: None, service_names=(),
                                      max_message_bytes=1 << 20)
        print("listening", running.port, flush=True)
        return running, cleanup_that_never_ends

    run_service(start, grace_s=0.2, stop_margin_s=1.0)
""")


STARTS_FOREVER = textwrap.dedent("""
    import asyncio, logging, sys, time
    from services.common.server import run_service

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    async def start():
        print("starting", flush=True)  # e.g. waiting on a state store that never answers
        await asyncio.Event().wait()

    async def start_blocking():
        print("starting", flush=True)  # e.g. an engine's load: the event loop is blocked
        time.sleep(3600)

    run_service(start_blocking if sys.argv[1:] == ["blocking"] else start, grace_s=0.2, stop_margin_s=1.0)
""")


def _wait_for_line(path: Path, text: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(errors="replace"):
        assert process.poll() is None or text in path.read_text(errors="replace"), path.read_text()
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s} s:\n{path.read_text()}"
        time.sleep(0.05)


def test_a_stop_that_never_ends_exits_saying_where_it_was_stuck(tmp_path):
    log = tmp_path / "service.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-c", SERVICE], stdout=sink, stderr=subprocess.STDOUT,
                                   cwd=Path(__file__).resolve().parents[2])
    try:
        _wait_for_line(log, "listening", process)
        process.send_signal(signal.SIGUSR1)  # where it is, while it serves
        _wait_for_line(log, "asyncio tasks:", process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 1  # grace 0.2 s + margin 1 s, then out: not waiting forever
    finally:
        process.kill()
        process.wait()
    text = log.read_text()
    assert "stacks (signal 10)" in text and "thread MainThread" in text
    assert "stopping did not finish within 1.2 s" in text
    stuck = text[text.index("stopping did not finish"):]
    assert "cleanup_that_never_ends" in stuck  # the innermost await of the stuck task, by name


@pytest.mark.parametrize("blocking", [False, True], ids=["awaiting", "blocking"])
def test_sigterm_while_starting_ends_the_process_at_once(tmp_path, blocking):
    log = tmp_path / "service.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-c", STARTS_FOREVER, *(["blocking"] if blocking else [])],
                                   stdout=sink, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    try:
        _wait_for_line(log, "starting", process)
        if not blocking:
            process.send_signal(signal.SIGUSR1)  # handled while starting too: not the default action (death)
            _wait_for_line(log, "asyncio tasks:", process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        process.kill()
        process.wait()
    assert "stopped while starting (signal 15)" in log.read_text()
