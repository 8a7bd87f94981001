"""The SDK's request options: one typed, frozen record, checked before anything is sent, that builds the same
message field by field (the services check the ranges)."""

from __future__ import annotations

import dataclasses

import pytest

from fastexp import AgentOptions, RequestOptions, Sampling, build_request
from fastexp.request import InvalidOption
from fastexp.v1 import experience_pb2


def test_options_are_typed_frozen_and_name_every_wrong_field():
    with pytest.raises(TypeError) as raised:
        RequestOptions(n_samples_per_prompt="4", gamma="high", max_staleness=1.5)
    message = str(raised.value)
    assert "n_samples_per_prompt: str" in message and "gamma: str" in message and "max_staleness: float" in message
    with pytest.raises(ValueError, match="partial_rollout: 'later' is not one of"):
        RequestOptions(n_samples_per_prompt=2, partial_rollout="later")
    with pytest.raises(TypeError, match="n_samples_per_prompt: bool"):
        RequestOptions(n_samples_per_prompt=True)
    options = RequestOptions(n_samples_per_prompt=4, gamma=1)  # an int is a fine float
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.gamma = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError, match="no_such_option"):
        build_request(["hi"], options, no_such_option=1)


def test_the_message_carries_every_option():
    options = RequestOptions(
        n_samples_per_prompt=4, sampling=Sampling(temperature=0.7, max_new_tokens=64), micro_rollout_batch_size=8,
        advantage_estimator="rloo", kl_coef=0.0, kl_estimator="k3", use_kl_loss=True, kl_target=0.1, kl_horizon=50,
        gamma=0.99, lambd=0.95, reward_running_norm=True, reward_clip=5.0, overlong_buffer_len=16,
        advantages_norm=True, advantage_clip=3.0, dynamic_sampling_num_groups=2, run_id="r",
        return_action_entropy=True, packing_samples=True, return_packed=True, max_staleness=1,
        partial_rollout="abort", normalization_scope="rollout", skip_actor_forward=True, request_id="id-1",
    )
    message = build_request(["a", [{"role": "user", "content": "b"}]], options, references=["1", "2"])
    assert [p.WhichOneof("prompt") for p in message.prompts] == ["text", "chat"]
    assert [p.reference for p in message.prompts] == ["1", "2"]
    assert message.n_samples_per_prompt == 4 and message.micro_rollout_batch_size == 8
    assert message.sampling.max_new_tokens == 64 and message.advantage_estimator == "rloo"
    assert (message.kl.kl_coef, message.kl.kl_estimator, message.kl.use_kl_loss) == (0.0, "k3", True)
    assert message.kl.kl_target == pytest.approx(0.1) and message.kl.kl_horizon == 50
    assert message.gamma == pytest.approx(0.99) and message.lambd == pytest.approx(0.95)
    assert message.reward_processing.overlong_buffer and message.dynamic_sampling.enabled
    assert message.max_staleness == 1 and message.skip_actor_forward and message.request_id == "id-1"
    assert message.partial_rollout == experience_pb2.PARTIAL_ROLLOUT_ABORT
    assert message.normalization_scope == experience_pb2.NORMALIZATION_SCOPE_ROLLOUT


def test_keyword_overrides_replace_fields_of_the_given_options():
    base = RequestOptions(n_samples_per_prompt=4, gamma=0.9)
    message = build_request(["a"], base, gamma=0.5)
    assert message.gamma == pytest.approx(0.5) and message.n_samples_per_prompt == 4
    assert base.gamma == 0.9  # the options object itself is unchanged
    assert build_request(["a"], n_samples_per_prompt=3).n_samples_per_prompt == 3  # options from keywords alone


def test_agent_options_name_the_operators_agent_on_the_wire():
    message = build_request(["What is 2 + 3?"], n_samples_per_prompt=2, agent=AgentOptions("calculator", max_calls=4))
    assert message.HasField("agent")
    assert (message.agent.name, message.agent.max_calls) == ("calculator", 4)
    assert message.agent == experience_pb2.AgentOptions(name="calculator", max_calls=4)
    unlimited = build_request(["a"], n_samples_per_prompt=2, agent=AgentOptions("calculator"))
    assert unlimited.agent.max_calls == 0  # the wire's "no limit but the episode's deadline"
    assert not build_request(["a"], n_samples_per_prompt=2).HasField("agent")  # no agent: unset


@pytest.mark.parametrize(("agent", "field"), [
    ({"name": ""}, "agent.name"), ({"name": "calculator", "max_calls": 0}, "agent.max_calls"),
    ({"name": "calculator", "max_calls": 2**32}, "agent.max_calls"),
])
def test_agent_options_check_their_fields(agent, field):
    with pytest.raises(InvalidOption) as raised:
        AgentOptions(**agent)
    assert raised.value.field == field and isinstance(raised.value, ValueError)


def test_agent_options_are_typed_and_frozen():
    with pytest.raises(TypeError, match="AgentOptions.max_calls: float"):
        AgentOptions("calculator", max_calls=4.0)
    with pytest.raises(TypeError, match="AgentOptions.name: NoneType"):
        AgentOptions(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="agent: str"):
        RequestOptions(n_samples_per_prompt=2, agent="calculator")  # the name alone is not the options
    with pytest.raises(dataclasses.FrozenInstanceError):
        AgentOptions("calculator").name = "other"  # type: ignore[misc]
