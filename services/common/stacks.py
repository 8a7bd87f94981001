"""Where a service is: every asyncio task's await chain and every thread's stack, as text for the log.

A service that hangs (a stop that does not finish, a stream that does not move) is asked with ``kill -USR1 <pid>``
(:func:`log_on_signal`), and a stop that overruns its limit writes the same before the process exits
(:mod:`services.common.server`). A task's own stack (``Task.get_stack``) holds only its outermost coroutine's
frame; :func:`task_stacks` follows the chain of awaits down to the innermost one, which is where it waits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

MAX_DEPTH = 64  # awaits followed per task at most (a chain is rarely deeper than 20)


def _await_chain(awaitable: Any) -> list[FrameType]:
    """The suspended frames from ``awaitable`` (a coroutine or async generator) down the awaits it waits on."""
    frames: list[FrameType] = []
    while awaitable is not None and len(frames) < MAX_DEPTH:
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None) \
            or getattr(awaitable, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None) \
            or getattr(awaitable, "gi_yieldfrom", None)
    return frames


def task_stacks(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """Each pending task of ``loop`` (the running loop's by default): its name, then its chain of awaits, the
    innermost last (where it waits). Call it on the loop's thread."""
    tasks = sorted(asyncio.all_tasks(loop), key=lambda task: task.get_name())
    parts = [f"{len(tasks)} asyncio tasks:"]
    for task in tasks:
        frames = _await_chain(task.get_coro())
        lines = traceback.format_list([(f.f_code.co_filename, f.f_lineno, f.f_code.co_name, None) for f in frames])
        parts.append(f"{task!r}:\n" + "".join(lines))
    return "\n".join(parts)


def thread_stacks() -> str:
    """Every thread's current stack, innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def log_on_signal(loop: asyncio.AbstractEventLoop, signum: int = signal.SIGUSR1) -> None:
    """Log every task's and thread's stack (WARNING) each time the process receives ``signum``."""
    loop.add_signal_handler(signum, lambda: logger.warning("stacks (signal %d):\n%s\n%s", signum,
                                                           task_stacks(loop), thread_stacks()))
