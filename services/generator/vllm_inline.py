"""vLLM's engine in the generator's own process: vLLM v1's synchronous ``LLMEngine`` (no engine-core process,
the ``uni`` executor: the model runs in this process too), stepped by one thread that owns it, behind the part of
``AsyncLLM``'s asynchronous interface that :class:`~services.generator.vllm_engine.VLLMEngine` uses.

Why: ``AsyncLLM`` always runs its engine core in a process of its own, which sends every step's outputs to the
caller's process; on a CPU host those processes share the cores with the model's OpenMP threads. Measured on 2
cores (benchmarks/README.md, "Where the rest of the generation gap is"): ``vllm.LLM`` with the engine in process
decoded 704 tokens/s, the same engine behind vLLM's process split 588-599. On a GPU host the split costs nothing
(the model runs on the device while the engine core schedules ahead), so there the generator keeps ``AsyncLLM``
(the setting ``vllm_engine_process``).

One thread owns the engine (vLLM's engine is not thread-safe): it is built there (so the model's OpenMP team and
its core binding, set at the worker's start, belong to the thread that steps it), and every call
(add, abort, ``collective_rpc``, pause, sleep) is a command the thread runs between two steps. Outputs go back to
the event loop of the request that asked (``call_soon_threadsafe``). A step that raises kills the engine: every
stream and waiting call gets vLLM's ``EngineDeadError``, as with ``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

#: How long :meth:`InlineLLM.shutdown` waits for the engine's thread to finish its step and stop (seconds).
SHUTDOWN_TIMEOUT_S = 60.0

Deliver = Callable[[Any], None]  # hands an output (or the error ending the stream) to its request's event loop


def inline_engine(engine_process: str, options: Mapping[str, Any]) -> bool:
    """Whether the engine runs in the generator's process: ``inline``/``separate`` as said; ``auto``: inline on a
    host without CUDA with one engine copy on one device (on CPU vLLM's process split costs the model cores:
    :mod:`services.generator.vllm_inline`), apart otherwise (on GPUs it overlaps scheduling with the device).

    Raises:
        ValueError: ``inline`` with tensor or data parallelism (several workers need vLLM's processes).
    """
    parallel = options.get("tensor_parallel_size", 1) * options.get("data_parallel_size", 1) > 1
    if engine_process == "inline" and parallel:
        raise ValueError("vllm_engine_process inline runs one worker: tensor/data parallelism needs 'separate'")
    return engine_process == "inline" or (engine_process == "auto" and not parallel and not _cuda())


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class InlineLLM:
    """vLLM's ``LLMEngine`` in this process, stepped by a thread of its own; methods named and behaving as
    ``AsyncLLM``'s: :meth:`generate`, :meth:`abort`, :meth:`pause_generation`/:meth:`resume_generation`
    (mode ``wait`` only), :meth:`collective_rpc`, :meth:`check_health`, :meth:`sleep`/:meth:`wake_up`,
    :meth:`shutdown`, :attr:`errored`, :attr:`vllm_config`, :attr:`model_config`, :meth:`get_tokenizer`."""

    def __init__(self) -> None:
        self._commands: queue.SimpleQueue[tuple[Callable[[Any], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._engine: Any = None
        self._dead: BaseException | None = None  # why the engine stopped; set once, by its thread
        self._closing = threading.Lock()  # a command is either queued before the engine stops or refused
        # owned by the engine's thread:
        self._streams: dict[str, Deliver] = {}
        self._paused = False
        self._held: dict[str, Callable[[Any], None]] = {}  # requests added while paused: added at resume
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
        ``RequestOutputKind.FINAL_ONLY``); a consumer that stops early aborts the request.

        Raises:
            EngineDeadError: the engine stopped (before or while the request ran).
            What vLLM raises on adding the request (a prompt too long, bad sampling parameters).
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def deliver(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the request's loop is closed: nobody waits for it
                loop.call_soon_threadsafe(outputs.put_nowait, item)

        def add(engine: Any) -> None:
            engine.add_request(request_id, prompt, sampling_params, lora_request=lora_request)

        await self._call(lambda engine: self._add(engine, request_id, add, deliver))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished and self._dead is None:
                self._post(lambda engine: self._abort(engine, [request_id]))

    async def abort(self, request_ids: list[str] | str) -> None:
        """Abort requests (unknown or finished ids are ignored); their streams end without output."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        await self._call(lambda engine: self._abort(engine, ids))

    async def pause_generation(self, *, mode: str = "wait", clear_cache: bool = True) -> None:
        """Hold new requests and return once the running ones have finished; with ``clear_cache``, then reset the
        prefix cache. Only ``mode="wait"`` (what the generator uses).

        Raises:
            ValueError: another ``mode``.
        """
        if mode != "wait":
            raise ValueError(f"InlineLLM pauses with mode 'wait' only, not {mode!r}")
        idle = await self._call(self._pause)
        await asyncio.wrap_future(idle)
        if clear_cache:
            await self._call(lambda engine: engine.reset_prefix_cache())

    async def resume_generation(self) -> None:
        """Add the requests held since :meth:`pause_generation` and step again."""
        await self._call(self._resume)

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call ``method`` on the worker (the ``worker_extension_cls``'s methods included) between two steps, on
        the engine's thread; a list of the one worker's answer.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds (the call still runs; it cannot be interrupted).
        """
        return await self._call(lambda engine: engine.collective_rpc(method, None, args, kwargs), timeout)

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` once the engine has stopped."""
        if self._dead is not None or self._thread is None or not self._thread.is_alive():
            raise _engine_dead(self._dead)

    async def sleep(self, level: int = 1, mode: str = "wait") -> None:
        """vLLM's sleep mode (where the platform has one)."""
        await self._call(lambda engine: engine.sleep(level, mode=mode))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(lambda engine: engine.wake_up(tags))

    def shutdown(self) -> None:
        """Stop stepping (running requests end with ``EngineDeadError``) and release the engine; waits up to
        :data:`SHUTDOWN_TIMEOUT_S` for the current step. Safe to call more than once."""
        if self._thread is None:
            return
        self._post(self._stop)
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("vLLM's engine thread did not stop within %.0f s", SHUTDOWN_TIMEOUT_S)
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

            _bind_model_threads()
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
                        waiter.set_result(None)
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
                    future.set_result(command(engine))
                except BaseException as error:  # the caller's error (a bad request), not the engine's
                    future.set_exception(error)
        return False

    def _add(self, engine: Any, request_id: str, add: Callable[[Any], None], deliver: Deliver) -> None:
        if self._paused:
            self._held[request_id] = add
        else:
            add(engine)
        self._streams[request_id] = deliver

    def _deliver(self, output: Any) -> None:
        deliver = self._streams.pop(output.request_id, None) if output.finished else self._streams.get(output.request_id)
        if deliver is not None:
            deliver(output)

    def _abort(self, engine: Any, request_ids: list[str]) -> None:
        engine.abort_request(request_ids)
        for request_id in request_ids:
            self._streams.pop(request_id, None)
            self._held.pop(request_id, None)

    def _pause(self, engine: Any) -> concurrent.futures.Future:
        self._paused = True
        idle: concurrent.futures.Future = concurrent.futures.Future()
        self._idle_waiters.append(idle)
        return idle

    def _resume(self, engine: Any) -> None:
        self._paused = False
        held, self._held = self._held, {}
        for add in held.values():
            add(engine)

    def _stop(self, engine: Any) -> None:
        self._stopping = True

    def _end(self, engine: Any) -> None:
        """The engine stopped: fail every stream, pause and waiting command, then release the engine."""
        error = _engine_dead(self._dead)
        for deliver in self._streams.values():
            deliver(error)
        self._streams.clear()
        for waiter in self._idle_waiters:
            waiter.set_exception(error)
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        try:
            engine.engine_core.shutdown()
        except Exception:
            logger.warning("vLLM's engine did not shut down cleanly", exc_info=True)


def _bind_model_threads() -> None:
    """Give the calling thread (the engine's: it runs the model) the cores of ``VLLM_CPU_OMP_THREADS_BIND`` and an
    OpenMP team of one thread per core, as vLLM's multiprocessing executor gives its worker process (through
    ``OMP_NUM_THREADS``, read once when a process starts: too late here, so torch's setter instead). The team's
    threads, created by this thread at its first parallel region, inherit its cores. ``auto`` or ``nobind``:
    every core this process may use, unbound."""
    import torch
    from vllm import envs
    from vllm.utils.cpu_resource_utils import parse_id_list

    bind = envs.VLLM_CPU_OMP_THREADS_BIND
    cores = os.sched_getaffinity(0) if bind in ("auto", "nobind") else set(parse_id_list(bind))
    if bind not in ("auto", "nobind"):
        os.sched_setaffinity(0, cores)  # 0: this thread only
    torch.set_num_threads(len(cores))
    logger.info("vLLM's model runs on %d threads (cores %s)", len(cores), sorted(cores))


def _engine_dead(cause: BaseException | None) -> BaseException:
    """vLLM's ``EngineDeadError`` (what ``AsyncLLM`` raises once its engine is gone), caused by ``cause``."""
    from vllm.v1.engine.exceptions import EngineDeadError

    error = EngineDeadError()
    error.__cause__ = cause
    return error
