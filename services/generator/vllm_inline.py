"""vLLM's engine in the generator's own process: vLLM v1's synchronous ``LLMEngine`` (``uni`` executor: the model
runs here too) stepped by one thread that owns it, behind the part of ``AsyncLLM``'s interface that
:class:`~services.generator.vllm_engine.VLLMEngine` uses. ``AsyncLLM`` always runs its engine core in a process of
its own, which on a CPU host takes cores the model's threads want (``vllm.LLM`` in process 704 tokens/s against
588-599 split, 2-core Intel host; benchmarks/README.md); a GPU host keeps it (setting ``vllm_engine_process``).

The engine is built on its thread (the model's OpenMP team belongs to the thread that steps it), and every call
(add, abort, ``collective_rpc``, pause, the weights' label) is a command that thread runs between two steps; outputs go back to
the asking request's event loop (``call_soon_threadsafe``). A step that raises kills the engine: every stream and
waiting call gets vLLM's ``EngineDeadError``, as with ``AsyncLLM``. Process-wide, as in vLLM's own engine-core
process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's environment cached at start, ``torch.set_num_threads`` a no-op.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from services.generator.cpu_threads import bind_model_threads

logger = logging.getLogger(__name__)

#: How long :meth:`InlineLLM.shutdown` waits for the engine's thread to finish its step and stop (seconds).
SHUTDOWN_TIMEOUT_S = 60.0


def inline_engine(engine_process: str, options: Mapping[str, Any]) -> bool:
    """Whether the engine runs in the generator's process: ``inline``/``separate`` as said; ``auto``: inline on a
    host without CUDA with one engine copy on one device (on CPU vLLM's process split costs the model cores:
    :mod:`services.generator.vllm_inline`), apart otherwise (on GPUs it overlaps scheduling with the device).
    ``options``: :func:`~services.generator.vllm_engine.engine_options`'s keywords.

    Raises:
        ValueError: ``inline`` with tensor or data parallelism (several workers need vLLM's processes), or with
            ``enable_sleep_mode`` where the platform has sleep mode (it needs vLLM's engine-core process).
    """
    cuda, sleep_mode = _platform()
    parallel = options.get("tensor_parallel_size", 1) * options.get("data_parallel_size", 1) > 1
    sleeps = bool(options.get("enable_sleep_mode")) and sleep_mode
    if engine_process == "inline" and (parallel or sleeps):
        raise ValueError("vllm_engine_process inline runs one worker without sleep mode: tensor/data parallelism "
                         "and enable_sleep_mode need 'separate'")
    return engine_process == "inline" or (engine_process == "auto" and not (parallel or sleeps or cuda))


def _platform() -> tuple[bool, bool]:
    """(CUDA available, vLLM's sleep mode available) on this host."""
    import torch
    from vllm.platforms import current_platform

    return torch.cuda.is_available(), current_platform.is_sleep_mode_available()


class InlineLLM:
    """vLLM's ``LLMEngine`` in this process, stepped by a thread of its own; methods named and behaving as
    ``AsyncLLM``'s (pauses in mode ``wait`` only, no sleep mode)."""

    def __init__(self) -> None:
        self._commands: queue.SimpleQueue[tuple[Callable[[Any], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._engine: Any = None
        self._dead: BaseException | None = None  # why the engine stopped; set once, by its thread
        self._closing = threading.Lock()  # a command is either queued before the engine stops or refused
        self._serial = itertools.count()
        # owned by the engine's thread:
        self._requests: dict[str, _Request] = {}  # by the engine's id of each request
        self._paused = False  # new requests are held (kept with their add) until resume
        self._idle_waiters: list[concurrent.futures.Future] = []  # pauses waiting for the running requests
        self._stopping = False

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> InlineLLM:
        """Build the engine in a new thread and return once it is up (the model loaded: a minute on a CPU).

        ``engine_args``: vLLM's ``EngineArgs``; its executor is set to ``uni`` (the model in this process).

        Raises:
            Whatever vLLM raises while it builds the engine.
        """
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by vLLM when it builds: no engine-core process
        engine_args.distributed_executor_backend = "uni"
        llm = cls()
        started: concurrent.futures.Future = concurrent.futures.Future()
        llm._thread = threading.Thread(target=llm._run, args=(engine_args, started), name="vllm-engine", daemon=True)
        llm._thread.start()
        llm._engine = started.result()
        return llm

    # --- read-only views (set before the thread steps, never changed) ---

    @property
    def vllm_config(self) -> Any:
        return self._engine.vllm_config

    @property
    def model_config(self) -> Any:
        return self._engine.model_config

    def get_tokenizer(self) -> Any:
        return self._engine.get_tokenizer()

    @property
    def errored(self) -> bool:
        """True once the engine has stopped (a step raised, or :meth:`shutdown`)."""
        return self._dead is not None

    # --- the asynchronous interface ---

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, lora_request: Any = None
    ) -> AsyncIterator[Any]:
        """Add one request and yield its ``RequestOutput``s until the one marked ``finished`` (one only with
        ``RequestOutputKind.FINAL_ONLY``; ``CUMULATIVE`` outputs share lists the engine's thread still appends to:
        use ``FINAL_ONLY`` or ``DELTA``); a consumer that stops early aborts the request, and one whose request
        :meth:`abort` ends stops without output. Each call is its own request in the engine, even where two share
        ``request_id`` (the outputs carry ``request_id``).

        Raises:
            EngineDeadError: the engine stopped (before or while the request ran).
            What vLLM raises on adding the request (a prompt too long, bad sampling parameters), also when it was
            held by a pause and added at resume.
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        engine_id = f"{request_id}#{next(self._serial)}"  # the engine's own id: unique per call

        def deliver(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the request's loop is closed: nobody waits for it
                loop.call_soon_threadsafe(outputs.put_nowait, item)

        def add(engine: Any) -> None:
            engine.add_request(engine_id, prompt, sampling_params, lora_request=lora_request)

        finished = False
        try:
            await self._call(lambda engine: self._add(engine, engine_id, _Request(request_id, deliver, add)))
            while not finished:
                item = await outputs.get()
                if item is None:  # aborted by abort()
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                item.request_id = request_id
                yield item
        finally:  # a cancel during the add too: the abort queues behind it
            if not finished and self._dead is None:
                self._post(lambda engine: self._drop(engine, [engine_id]))

    async def abort(self, request_ids: list[str] | str) -> None:
        """Abort the requests of these ids (unknown or finished ones ignored); their streams end without output."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        await self._call(lambda engine: self._abort(engine, ids))

    async def pause_generation(self, *, mode: str = "wait", clear_cache: bool = True) -> None:
        """Hold new requests and return once the running ones have finished; with ``clear_cache``, then empty the
        prefix, multimodal and encoder caches (their entries came from the weights in use). Only ``mode="wait"``
        (what the generator uses). A caller cancelled while it waits leaves the engine paused (call
        :meth:`resume_generation`).

        Raises:
            ValueError: another ``mode``.
            RuntimeError: vLLM could not reset its prefix cache.
        """
        if mode != "wait":
            raise ValueError(f"InlineLLM pauses with mode 'wait' only, not {mode!r}")
        idle = await self._call(self._pause)
        await asyncio.shield(asyncio.wrap_future(idle))
        if clear_cache:
            await self._call(_clear_caches)

    async def resume_generation(self) -> None:
        """Add the requests held since :meth:`pause_generation` and step again (a held request vLLM rejects now
        ends its own stream with the error)."""
        await self._call(self._resume)

    async def update_weight_version(self, new_version: str) -> None:
        """Label the tokens of every later step ``new_version`` (vLLM's ``set_weight_version``)."""
        await self._call(lambda engine: engine.set_weight_version(new_version))

    async def collective_rpc(
        self, method: str | Callable[[Any], Any], timeout: float | None = None, args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on the worker (the ``worker_extension_cls``'s methods included) between two steps, on
        the engine's thread; a list of the one worker's answer.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds, counted from the call (the wait behind the current
                step and earlier calls included); the call still runs: it cannot be interrupted.
        """
        return await self._call(lambda engine: engine.collective_rpc(method, None, args, kwargs), timeout)

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` once the engine has stopped."""
        if self._dead is not None or self._thread is None or not self._thread.is_alive():
            raise _engine_dead(self._dead)

    async def sleep(self, level: int = 1, mode: str = "wait") -> None:
        """Refused: vLLM's sleep mode needs its engine-core process (an in-process engine cannot wait for running
        requests, and :func:`inline_engine` never runs one in process where the platform has sleep mode).

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("sleep mode needs vllm_engine_process 'separate'")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        raise RuntimeError("sleep mode needs vllm_engine_process 'separate'")  # as sleep()

    def shutdown(self) -> None:
        """Stop stepping (running requests end with ``EngineDeadError``) and release the engine; waits up to
        :data:`SHUTDOWN_TIMEOUT_S` for the current step. Safe to call more than once."""
        thread = self._thread
        if thread is None:
            return
        self._post(lambda engine: setattr(self, "_stopping", True))
        thread.join(SHUTDOWN_TIMEOUT_S)
        if thread.is_alive():
            logger.warning("vLLM's engine thread did not stop within %.0f s", SHUTDOWN_TIMEOUT_S)
            return
        self._thread = None

    # --- the caller's side of a command ---

    def _post(self, command: Callable[[Any], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._closing:
            if self._dead is None:
                self._commands.put((command, future))
                return future
        future.set_exception(_engine_dead(self._dead))
        return future

    async def _call(self, command: Callable[[Any], Any], timeout: float | None = None) -> Any:
        # shielded: a caller that gives up (or times out) leaves the command to run, as vLLM's own RPCs do
        async with asyncio.timeout(timeout):
            return await asyncio.shield(asyncio.wrap_future(self._post(command)))

    # --- the engine's thread ---

    def _run(self, engine_args: Any, started: concurrent.futures.Future) -> None:
        try:
            from vllm.v1.engine.llm_engine import LLMEngine

            bind_model_threads()
            engine = LLMEngine.from_engine_args(engine_args, enable_multiprocessing=False)
        except BaseException as error:
            with self._closing:
                self._dead = error
            started.set_exception(error)
            return
        started.set_result(engine)
        try:
            while True:
                if self._idle_waiters and not engine.has_unfinished_requests():  # a pause's running requests ended
                    for waiter in self._idle_waiters:
                        _settle(waiter, None)
                    self._idle_waiters.clear()
                if not self._take_commands(engine, block=not engine.has_unfinished_requests()):
                    break
                if engine.has_unfinished_requests():
                    for output in engine.step():
                        self._deliver(output)
        except BaseException as error:
            logger.exception("vLLM's engine stopped")
            with self._closing:
                self._dead = error
        finally:
            with self._closing:
                self._dead = self._dead or RuntimeError("the engine was shut down")
            self._end(engine)

    def _take_commands(self, engine: Any, *, block: bool) -> bool:
        """Run the waiting commands (the first one waited for when ``block``); False once stopping."""
        while not self._stopping:
            try:
                command, future = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if future.set_running_or_notify_cancel():
                try:
                    result = command(engine)
                except BaseException as error:  # the caller's error (a bad request), not the engine's
                    _settle(future, error=error)
                else:
                    _settle(future, result)
        return False

    def _add(self, engine: Any, engine_id: str, request: _Request) -> None:
        if not self._paused:
            request.add(engine)
            request.add = None
        self._requests[engine_id] = request

    def _deliver(self, output: Any) -> None:
        request = self._requests.pop(output.request_id, None) if output.finished else self._requests.get(
            output.request_id)
        if request is not None:
            request.deliver(output)

    def _drop(self, engine: Any, engine_ids: list[str]) -> None:
        """Abort requests whose consumer is gone."""
        engine.abort_request(engine_ids)
        for engine_id in engine_ids:
            self._requests.pop(engine_id, None)

    def _abort(self, engine: Any, request_ids: set[str]) -> None:
        """Abort the requests of these callers' ids and end their streams without output."""
        aborted = [engine_id for engine_id, request in self._requests.items() if request.request_id in request_ids]
        engine.abort_request([engine_id for engine_id in aborted if self._requests[engine_id].add is None])
        for engine_id in aborted:
            self._requests.pop(engine_id).deliver(None)

    def _pause(self, engine: Any) -> concurrent.futures.Future:
        self._paused = True
        idle: concurrent.futures.Future = concurrent.futures.Future()
        self._idle_waiters.append(idle)
        return idle

    def _resume(self, engine: Any) -> None:
        self._paused = False
        for engine_id, request in [(i, r) for i, r in self._requests.items() if r.add is not None]:
            add, request.add = request.add, None
            try:
                add(engine)
            except Exception as error:  # rejected now: its own stream ends with the error, the others go on
                self._requests.pop(engine_id)
                request.deliver(error)

    def _end(self, engine: Any) -> None:
        """The engine stopped: fail every stream, pause and waiting command, then release the engine."""
        error = _engine_dead(self._dead)
        for request in self._requests.values():
            request.deliver(error)
        self._requests.clear()
        for waiter in self._idle_waiters:
            _settle(waiter, error=error)
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                _settle(future, error=error)
        try:
            engine.engine_core.shutdown()
        except Exception:
            logger.warning("vLLM's engine did not shut down cleanly", exc_info=True)


@dataclasses.dataclass
class _Request:
    """One request as the engine's thread keeps it: the caller's id, where its outputs go, and while a pause holds
    it, how to add it (None once added)."""

    request_id: str
    deliver: Callable[[Any], None]  # an output, the error ending the stream, or None (aborted), to its event loop
    add: Callable[[Any], None] | None


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless its caller cancelled it meanwhile (then nobody reads it)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _clear_caches(engine: Any) -> None:
    """Empty what was computed with the weights in use: the prefix cache (KV), the multimodal processor's and the
    encoder's caches (vision embeddings), as ``AsyncLLM``'s ``pause_generation(clear_cache=True)`` does.

    Raises:
        RuntimeError: vLLM could not reset the prefix cache (a request still running).
    """
    if not engine.reset_prefix_cache():
        raise RuntimeError("vLLM could not reset its prefix cache")
    engine.reset_mm_cache()
    engine.reset_encoder_cache()


def _engine_dead(cause: BaseException | None) -> BaseException:
    """vLLM's ``EngineDeadError`` (what ``AsyncLLM`` raises once its engine is gone), caused by ``cause``."""
    from vllm.v1.engine.exceptions import EngineDeadError

    error = EngineDeadError()
    error.__cause__ = cause
    return error
