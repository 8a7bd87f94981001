"""services.common.tasks.run_to_end: work that ends whole when its caller is cancelled (real asyncio tasks)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common.tasks import run_to_end


async def test_a_cancelled_caller_waits_for_the_work_to_end_then_is_cancelled():
    started, release, steps = asyncio.Event(), asyncio.Event(), []

    async def work() -> int:
        started.set()
        await release.wait()
        steps.append("work ended")
        return 7

    async def caller() -> None:
        await run_to_end(work(), "the work")
        steps.append("caller went on")  # never: it was cancelled

    task = asyncio.create_task(caller())
    await started.wait()
    task.cancel()
    task.cancel()  # twice: still one end
    await asyncio.sleep(0)  # the cancellation is delivered to the caller's wait
    assert not task.done()  # still waiting for the work
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["work ended"]


async def test_the_result_or_the_error_reaches_a_caller_still_there():
    async def answer() -> str:
        await asyncio.sleep(0)
        return "done"

    async def fail() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad weights")

    assert await run_to_end(answer(), "answer") == "done"
    with pytest.raises(ValueError, match="bad weights"):
        await run_to_end(fail(), "fail")


async def test_the_error_of_work_whose_caller_has_gone_is_logged(caplog):
    started, release = asyncio.Event(), asyncio.Event()

    async def fail() -> None:
        started.set()
        await release.wait()
        raise ValueError("bad weights")

    task = asyncio.create_task(run_to_end(fail(), "a weight update"))
    await started.wait()
    with caplog.at_level(logging.INFO, logger="services.common.tasks"):
        task.cancel()
        await asyncio.sleep(0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    messages = [record.getMessage() for record in caplog.records]
    assert "a weight update goes on to its end: its caller has gone" in messages
    assert "a weight update failed after its caller had gone" in messages


async def test_a_refused_upload_is_read_to_its_end_before_the_error_ends_the_call():
    from services.common.tasks import lingering

    read = []

    async def upload():
        for i in range(100):
            read.append(i)
            yield i

    messages = upload()
    with pytest.raises(ValueError, match="bad tensor"):
        async with lingering(messages):
            assert await anext(messages) == 0
            raise ValueError("bad tensor")
    assert read == list(range(100))  # the client could send everything before the status went out


async def test_a_client_that_never_ends_its_upload_is_read_for_a_bounded_time():
    from services.common.tasks import lingering

    forever = asyncio.Event()

    async def stalled():
        yield 0
        await forever.wait()  # never set: a client that neither sends nor half-closes
        yield 1

    with pytest.raises(ValueError, match="bad tensor"):  # the call's own error, once the drain gives up
        async with lingering(stalled(), linger_s=0.05):
            raise ValueError("bad tensor")
