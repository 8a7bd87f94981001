"""SamplingOptions checks each field's range when built, and the services refuse the same values on the wire with
the same reason, naming ``sampling.<field>`` (one definition: the record's)."""

from __future__ import annotations

import pytest

from fastexp.sampling import InvalidSampling, SamplingOptions
from fastexp.v1 import generation_pb2
from fastexp.wire import sampling_to_pb
from services.common.errors import InvalidRequest
from services.common.sampling import sampling_from_pb

NAN, INF = float("nan"), float("inf")

#: (fields, the field named, words of the reason); every value here can also travel on the wire
ON_THE_WIRE = [
    ({"temperature": NAN}, "temperature", "must be finite and >= 0, got nan"),
    ({"temperature": INF}, "temperature", "must be finite and >= 0, got inf"),
    ({"temperature": -0.5}, "temperature", "must be finite and >= 0, got -0.5"),
    ({"top_p": 0.0}, "top_p", "must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p", "must be in (0, 1], got 1.5"),
    ({"top_p": NAN}, "top_p", "must be in (0, 1], got nan"),
    ({"top_k": -2}, "top_k", "must be >= 0, or -1 (0 and -1 disable), got -2"),
    ({"first_token_temperature": 0.0}, "first_token_temperature", "must be finite and > 0, got 0.0"),
    ({"first_token_temperature": NAN}, "first_token_temperature", "must be finite and > 0, got nan"),
    ({"temperature": 0.0, "first_token_temperature": 2.0}, "first_token_temperature", "needs temperature > 0"),
]
#: ranges only the record can be outside of (the wire's integer types cannot hold these values)
OFF_THE_WIRE = [
    ({"top_k": 2**31}, "top_k", "at most 2147483647 (int32)"),
    ({"max_new_tokens": 0}, "max_new_tokens", "must be in [1, 4294967295] (None: the service's default), got 0"),
    ({"max_new_tokens": 2**32}, "max_new_tokens", "must be in [1, 4294967295]"),
    ({"min_new_tokens": -1}, "min_new_tokens", "must be in [0, 4294967295], got -1"),
    ({"seed": -1}, "seed", "must be in [0, 2**64 - 1], got -1"),
    ({"seed": 2**64}, "seed", "must be in [0, 2**64 - 1]"),
]


@pytest.mark.parametrize(("fields", "field", "reason"), ON_THE_WIRE + OFF_THE_WIRE)
def test_a_field_outside_its_range_is_refused_naming_it(fields, field, reason):
    with pytest.raises(InvalidSampling) as caught:
        SamplingOptions(**fields)
    assert isinstance(caught.value, ValueError)
    assert caught.value.field == field
    assert reason in caught.value.reason and str(caught.value).startswith(f"SamplingOptions.{field}: ")


@pytest.mark.parametrize(("fields", "field", "reason"), ON_THE_WIRE)
def test_the_service_refuses_the_same_values_on_the_wire_with_the_records_reason(fields, field, reason):
    message = generation_pb2.SamplingParams(**fields)
    with pytest.raises(InvalidRequest) as caught:
        sampling_from_pb(message, default_max_new_tokens=32, max_new_tokens_limit=512)
    assert caught.value.field == f"sampling.{field}"
    assert reason in caught.value.reason
    assert str(caught.value).startswith(f"sampling.{field}: ")


@pytest.mark.parametrize(("fields", "wrong"), [
    ({"temperature": "1.0"}, "temperature"), ({"top_k": 1.5}, "top_k"), ({"max_new_tokens": True}, "max_new_tokens"),
    ({"seed": 1.0}, "seed"), ({"ignore_eos": 1}, "ignore_eos"), ({"first_token_temperature": "hot"},
                                                                  "first_token_temperature"),
])
def test_a_field_of_the_wrong_type_is_a_type_error_naming_it(fields, wrong):
    with pytest.raises(TypeError, match=f"SamplingOptions.{wrong}: "):
        SamplingOptions(**fields)


def test_the_ends_of_each_range_are_accepted():
    greedy = SamplingOptions(temperature=0, top_p=1.0, top_k=2**31 - 1, max_new_tokens=1, min_new_tokens=1,
                             seed=2**64 - 1)
    assert greedy.temperature == 0 and greedy.seed == 2**64 - 1
    assert SamplingOptions(temperature=0.7, first_token_temperature=1e-3).temperature_at(0) == 1e-3
    assert SamplingOptions(max_new_tokens=None, seed=0).max_new_tokens is None


def test_top_k_minus_one_is_off_and_stored_as_zero():
    assert SamplingOptions(top_k=-1).top_k == 0
    assert sampling_to_pb(SamplingOptions(top_k=-1)).top_k == 0


def test_min_new_tokens_against_max_new_tokens_is_the_services_check():
    """The service's default may fill max_new_tokens, and the services shrink it to a turn's budget: the record
    takes any pair; the service compares them once max_new_tokens is known."""
    options = SamplingOptions(max_new_tokens=8, min_new_tokens=9)
    with pytest.raises(InvalidRequest) as caught:
        sampling_from_pb(sampling_to_pb(options), default_max_new_tokens=32, max_new_tokens_limit=512)
    assert caught.value.field == "sampling.min_new_tokens" and "must not exceed max_new_tokens (8)" in caught.value.reason
    unset = generation_pb2.SamplingParams(min_new_tokens=40)
    with pytest.raises(InvalidRequest, match=r"sampling.min_new_tokens: must not exceed max_new_tokens \(32\)"):
        sampling_from_pb(unset, default_max_new_tokens=32, max_new_tokens_limit=512)


def test_the_services_decode_unset_fields_to_the_records_defaults_and_check_their_limit():
    decoded = sampling_from_pb(generation_pb2.SamplingParams(), default_max_new_tokens=32, max_new_tokens_limit=512)
    assert decoded == SamplingOptions(max_new_tokens=32)
    with pytest.raises(InvalidRequest, match="sampling.max_new_tokens: at most 512 allowed, got 513"):
        sampling_from_pb(generation_pb2.SamplingParams(max_new_tokens=513), default_max_new_tokens=32,
                         max_new_tokens_limit=512)
    prefixed = generation_pb2.SamplingParams(top_p=2.0)
    with pytest.raises(InvalidRequest, match=r"^turn.top_p: must be in \(0, 1\]"):
        sampling_from_pb(prefixed, default_max_new_tokens=32, max_new_tokens_limit=512, field="turn")
