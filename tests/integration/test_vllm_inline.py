"""vLLM's engine in the generator's process (:class:`services.generator.vllm_inline.InlineLLM`): a real engine on the
tiny Llama, driven by ``tests/support/inline_engine.py`` in a process of its own (see there why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.generator.vllm_inline import inline_engine

pytestmark = pytest.mark.vllm

CORES = sorted(os.sched_getaffinity(0))[:2]  # the engine's, whatever OMP_NUM_THREADS says
BIND = ",".join(map(str, CORES))


@pytest.fixture(scope="module")
def seen(tiny_model_path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("inline") / "seen.json"
    done = subprocess.run([sys.executable, "-m", "tests.support.inline_engine", tiny_model_path, str(out)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": BIND, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_concurrent_requests_each_run_to_their_own_end(seen):
    assert seen["concurrent_tokens"] == [8 + i for i in range(8)]


def test_two_calls_with_one_id_are_two_requests(seen):
    assert seen["twin_tokens"] == [5, 9]


def test_a_consumer_that_gives_up_aborts_its_request(seen):
    assert (seen["given_up_running"], seen["given_up_after_cancel"]) == (1, 0)


def test_a_pause_waits_for_running_requests_and_holds_new_ones_until_resume(seen):
    assert seen["pause_returned_after_running_request"]
    assert (seen["held_while_paused"], seen["running_while_paused"]) == (1, 0)
    assert seen["held_tokens_after_resume"] == 12


def test_held_requests_end_alone_when_aborted_or_rejected_at_resume(seen):
    # aborted: no output; rejected by vLLM at resume (a token id past the vocabulary): its own error; the third runs
    assert seen["held_outcomes"] == [0, "VLLMValidationError", 6]


def test_a_pause_whose_caller_is_cancelled_leaves_the_engine_serving(seen):
    # the running request aborted (no output) to end the pause, then a new one served
    assert seen["after_cancelled_pause"] == [0, 1, False]


def test_worker_calls_set_the_model_threads_on_the_engine_thread(seen):
    assert seen["rpc_on_engine_thread"]
    assert seen["threads_setup"] == [len(CORES)]  # one per core of VLLM_CPU_OMP_THREADS_BIND
    assert seen["threads_set_1"] == [1] and seen["threads_read"] == [1]


def test_records_carry_the_version_of_the_weights_that_sampled_them(seen):
    # the running request ended on the old weights; the held one's samples ran after the load, on version 1 (its
    # request arrived while the generator still said 0)
    assert seen["version_held_at_resume"] == [3]  # the three samples reached the engine during the pause
    assert seen["version_updated"] == 1
    assert seen["version_running"] == [0]
    assert seen["version_held"] == [1, 1, 1]
    assert seen["version_after"] == [1]


def test_a_step_that_raises_fails_every_stream_and_later_call(seen):
    assert seen["streams_after_death"] == ["EngineDeadError", "EngineDeadError"]
    assert seen["errored"] and seen["health_after_death"] == "EngineDeadError"
    assert seen["request_after_death"] == "EngineDeadError"
    assert seen["thread_stopped"]


@pytest.mark.parametrize(("setting", "options", "cuda", "inline"), [
    ("auto", {}, False, True),
    ("auto", {"enable_sleep_mode": True}, False, True),  # a platform without sleep mode (vLLM's CPU build)
    ("auto", {}, True, False),
    ("auto", {"tensor_parallel_size": 2}, False, False),
    ("separate", {}, False, False),
    ("inline", {}, True, True),
])
def test_where_the_engine_runs(monkeypatch, setting, options, cuda, inline):
    import services.generator.vllm_inline as module

    monkeypatch.setattr(module, "_platform", lambda: (cuda, False))
    assert inline_engine(setting, options) is inline


def test_sleep_mode_keeps_the_engine_apart(monkeypatch):
    import services.generator.vllm_inline as module

    monkeypatch.setattr(module, "_platform", lambda: (True, True))
    assert inline_engine("auto", {"enable_sleep_mode": True}) is False
    with pytest.raises(ValueError, match="separate"):
        inline_engine("inline", {"enable_sleep_mode": True})


def test_inline_refuses_parallelism():
    with pytest.raises(ValueError, match="separate"):
        inline_engine("inline", {"data_parallel_size": 2})


def test_no_earlier_test_ran_vllm_in_this_process():
    """vLLM's CPU worker in process makes ``torch.set_num_threads`` a no-op for the whole process: a test that
    started one here (the in-process generator tests: ``engine_process="separate"``) broke the thread counts of the
    tests after it (CI of 2026-11-26)."""
    import torch

    assert torch.set_num_threads.__name__ != "skip_set_num_threads"


def test_adapters_loaded_in_process_are_kept_as_sent_and_rebuilt_alike(seen):
    # a (scaling 1) and b (scaling 2): the worker keeps the tensors it was handed (no bytes copy), vLLM's builds and
    # rebuilds after eviction leave them as sent (b's scaling is folded into a copy), and each rebuilt adapter
    # samples what it sampled first; each adapter does change the model's log-probs (the checks are not vacuous)
    assert seen["adapter_kept_uncopied"] == [True, True]
    assert seen["adapter_kept_as_sent"] == [True, True]
    assert seen["adapter_rebuilt_alike"] == [True, True]
    assert seen["adapter_changes_log_probs"] == [True, True]
