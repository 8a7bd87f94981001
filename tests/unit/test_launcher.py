"""The launcher's share-out of a CPU host's cores between the generator's engine and the forwards."""

from __future__ import annotations

import pytest

from services.launcher import CoreSplit


@pytest.mark.parametrize(("cores", "engine", "threads"), [(1, (0,), 1), (2, (0,), 1), (3, (0,), 2), (16, tuple(range(8)), 8)])
def test_the_engine_gets_every_core_and_half_of_them_while_forwards_run(cores, engine, threads):
    split = CoreSplit.for_host(cores)
    assert split.engine_cores == engine and split.forward_threads == threads
    shares = cores > 1
    assert split.environment("generator") == {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1 if shares else 0}",
                                              "OMP_NUM_THREADS": str(len(engine))}
    sharing = {"FASTEXP_EXPERIENCE_GENERATOR_CPU_THREADS_SHARING": str(len(engine))} if shares else {}
    assert split.environment("experience") == {"FASTEXP_EXPERIENCE_TORCH_THREADS": str(threads),
                                               "FASTEXP_EXPERIENCE_TORCH_THREADS_IDLE": str(cores), **sharing}
    assert split.environment("scorer") == {}


def test_several_replicas_keep_their_blocks_and_the_engines_their_threads():
    """Replicas on one host each keep a block of the engine cores (an engine lent every core would run on its
    neighbours'), and the experience service is not told to move threads."""
    split = CoreSplit.for_host(4)
    assert [split.environment("generator", i, 2)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(2)] == ["0-0", "1-1"]
    assert "FASTEXP_EXPERIENCE_GENERATOR_CPU_THREADS_SHARING" not in split.environment("experience", 0, 2)


@pytest.mark.parametrize(
    ("engine", "replicas", "binds"),
    [((0, 1), 2, ["0-0", "1-1"]), ((0,), 2, ["0-0", "0-0"]), (tuple(range(8)), 2, ["0-3", "4-7"]),
     ((0, 1, 2), 2, ["0-0", "1-1"])],
)
def test_generator_replicas_get_equal_blocks_of_the_engine_cores(engine, replicas, binds):
    split = CoreSplit(engine, 1)
    assert [split.environment("generator", i, replicas)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(replicas)] == binds


def test_ports_for_services_come_from_below_the_ephemeral_range():
    """Ports the kernel hands out to other processes meanwhile (vLLM's engine opens several while it starts) come
    from the ephemeral range; a service's port from below it cannot be taken by them before the service binds."""
    from services.launcher import _ephemeral_range_start, free_port

    low = _ephemeral_range_start()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports)
