import pydantic
import pytest

from services.experience.settings import ExperienceSettings
from services.generator.settings import GeneratorSettings


def test_precedence_flags_over_env_over_yaml_over_defaults(tmp_path, monkeypatch):
    config = tmp_path / "fastexp.yaml"
    config.write_text("generator:\n  port: 6001\n  max_model_len: 512\n  backend: hf\nscorer:\n  port: 6002\n")
    monkeypatch.setenv("FASTEXP_GENERATOR_MAX_MODEL_LEN", "1024")
    settings = GeneratorSettings.load(config, backend="vllm", host=None)
    assert settings.backend == "vllm"  # flag
    assert settings.max_model_len == 1024  # env over yaml
    assert settings.port == 6001  # yaml over default
    assert settings.seed == 0  # default


def test_every_invalid_field_is_reported_at_once(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("experience:\n  port: -3\n  forward_micro_batch_size: 0\n  no_such_field: 1\n")
    with pytest.raises(pydantic.ValidationError) as info:
        ExperienceSettings.load(config)
    fields = {e["loc"][0] for e in info.value.errors()}
    assert {"port", "forward_micro_batch_size", "no_such_field"} <= fields
