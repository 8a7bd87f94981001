"""Bad MakeExperiences input is rejected before generation, with the offending field named."""

import functools

import pytest
from transformers import AutoTokenizer

from fastexp import Sampling, build_request
from fastexp.v1 import experience_pb2, generation_pb2
from services.common.errors import InvalidRequest
from services.common.sampling import RequestLimits
from services.experience.api.request import decode_request
from services.experience.pipeline.streams import MemoryStreams

LIMITS = RequestLimits(max_prompts_per_request=8, max_samples_per_prompt=16, max_new_tokens_limit=512,
                       default_max_new_tokens=32)
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def _request(**changes):
    options = {"n_samples_per_prompt": 2}
    options.update(changes)
    prompts = options.pop("prompts", [[{"role": "user", "content": "What is 2 + 3?"}]])
    return build_request(prompts, **options)


def _wire(path: str, value, **changes):
    """A request whose wire field ``path`` holds ``value``: one the SDK refuses to build (RequestOptions checks its
    ranges), which the service must refuse too, for any other client."""
    message = _request(**changes)
    *parents, name = path.split(".")
    setattr(functools.reduce(getattr, parents, message), name, value)
    return message


def test_valid_chat_request_is_rendered_with_the_chat_template(tokenizer):
    decoded = decode_request(_request(references=["5"]), tokenizer, LIMITS, MAX_MODEL_LEN)
    (prompt,) = decoded.prompts
    assert prompt.text.startswith("<|im_start|>system") and prompt.text.endswith("<|im_start|>assistant\n")
    assert list(prompt.token_ids) == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    assert prompt.reference == "5"
    # left unset by the SDK, so the service's defaults: LIMITS.default_max_new_tokens, group_norm, k1
    assert decoded.sampling.max_new_tokens == 32
    assert decoded.config.estimator.name == "group_norm" and decoded.config.kl.kl_estimator == "k1"


@pytest.mark.parametrize(
    ("request_", "field", "why"),
    [
        (experience_pb2.MakeExperiencesRequest(n_samples_per_prompt=2), "prompts", "at least one"),
        (_request(prompts=[""]), "prompts[0]", "empty"),
        (_request(prompts=["ok", []]), "prompts[1].chat", "at least one message"),
        (_wire("n_samples_per_prompt", 0), "n_samples_per_prompt", ">= 1"),
        (_request(n_samples_per_prompt=17), "n_samples_per_prompt", "at most 16"),
        (_wire("sampling.temperature", float("nan")), "sampling.temperature", "finite"),
        (_wire("sampling.temperature", -0.5), "sampling.temperature", ">= 0"),
        (_wire("sampling.temperature", float("inf")), "sampling.temperature", "finite"),
        (_wire("sampling.top_p", 0.0), "sampling.top_p", "(0, 1]"),
        (_wire("sampling.top_p", 1.5), "sampling.top_p", "(0, 1]"),
        (_request(sampling=Sampling(max_new_tokens=1000)), "sampling.max_new_tokens", "at most 512"),
        (_request(sampling=Sampling(max_new_tokens=8, min_new_tokens=9)), "sampling.min_new_tokens", "exceed"),
        (_request(prompts=["word " * 100]), "prompts[0]", "limit is 64"),
        (_request(advantage_estimator="ppo2"), "advantage_estimator", "unknown estimator 'ppo2'"),
        (_request(advantage_estimator="group_norm", n_samples_per_prompt=1), "n_samples_per_prompt",
         "group std is undefined"),
        (_request(advantage_estimator="rloo", n_samples_per_prompt=1), "n_samples_per_prompt", "leave-one-out"),
        (_request(advantage_estimator="dr_grpo", n_samples_per_prompt=1), "n_samples_per_prompt",
         "group mean of one sample"),
        (_wire("kl.kl_coef", -1.0), "kl.kl_coef", ">= 0"),
        (_request(kl_estimator="k9"), "kl.kl_estimator", "unknown"),
        (_wire("gamma", 1.5), "gamma", "[0, 1]"),
        (_wire("gamma", float("nan")), "gamma", "[0, 1]"),
        (_wire("lambd", -0.1), "lambd", "[0, 1]"),
        (_wire("lambd", 1.01), "lambd", "[0, 1]"),
        (_request(advantage_estimator="gae"), "advantage_estimator", "needs a critic"),
        (_request(advantage_estimator="cpgd", n_samples_per_prompt=1), "n_samples_per_prompt", "group statistics"),
        (_wire("reward_processing.reward_clip", -1.0), "reward_processing.reward_clip", ">= 0"),
        (_wire("advantage_processing.advantage_clip", -0.5), "advantage_processing.advantage_clip", ">= 0"),
        (_request(overlong_buffer_len=300, sampling=Sampling(max_new_tokens=256)),
         "reward_processing.overlong_buffer_len", "max_new_tokens=256"),
        (_wire("reward_processing.overlong_buffer_penalty_factor", -1.0, overlong_buffer_len=16),
         "reward_processing.overlong_buffer_penalty_factor", ">= 0"),
        (_request(reward_running_norm_minus_mean=True), "reward_processing.reward_running_norm_minus_mean",
         "needs reward_processing.reward_running_norm"),
        (_wire("kl.kl_target", 0.0), "kl.kl_target", "> 0"),
        (_request(skip_actor_forward=True, return_action_entropy=True), "return_action_entropy",
         "not with skip_actor_forward"),
        (_wire("kl.kl_horizon", 0, kl_target=0.1), "kl.kl_horizon", ">= 1"),
        (_request(dynamic_sampling_num_groups=2), "dynamic_sampling.num_groups", "len(prompts)=1"),
        (_request(dynamic_sampling_num_groups=1, n_samples_per_prompt=1, advantage_estimator="reinforce"),
         "dynamic_sampling.enabled", "n_samples_per_prompt >= 2"),
        (_request(dynamic_sampling_num_groups=1, dynamic_sampling_max_extra_rounds=17),
         "dynamic_sampling.max_extra_rounds", "at most 16"),
        (_request(run_id="r" * 257), "run_id", "at most 256"),
        (_request(normalization_scope="rollout", max_staleness=1), "normalization_scope", "max_staleness"),
        (_request(prompts=["word " * 10], max_prompt_tokens=5), "prompts[0]", "limit is 5 prompt tokens"),
        (_request(max_prompt_tokens=64), "max_prompt_tokens", "below the model's length 64"),
        (_request(prompts=["word " * 100], prompt_overflow="skip"), "prompts", "every prompt is longer than 63"),
        (_wire("rollout_correction.threshold", 0.5, rollout_is="token"), "rollout_correction.threshold", ">= 1"),
        (_wire("rollout_correction.threshold", float("inf"), rollout_is="sequence"), "rollout_correction.threshold",
         "finite"),
        (_request(rollout_is_threshold=3.0), "rollout_correction.threshold", "set a level"),
        (_request(rollout_is="token", skip_actor_forward=True), "rollout_correction.level", "actor forward"),
    ],
)
def test_bad_input_names_the_field(tokenizer, request_, field, why):
    with pytest.raises(InvalidRequest) as info:
        decode_request(request_, tokenizer, LIMITS, MAX_MODEL_LEN)
    assert info.value.field == field
    assert why in info.value.reason


def test_all_options_decode_into_the_config(tokenizer):
    message = _request(
        prompts=["a", "b", "c"], advantage_estimator="gae", gamma=0.0, lambd=0.95, kl_target=0.2, kl_horizon=50,
        reward_running_norm=True, reward_running_norm_minus_mean=True, reward_clip=5.0, overlong_buffer_len=16,
        overlong_buffer_penalty_factor=0.5, advantages_norm=True, advantage_clip=2.0, dynamic_sampling_num_groups=2,
        dynamic_sampling_max_extra_rounds=1, run_id="run-7", return_action_entropy=True, packing_samples=True,
        return_packed=True, normalization_scope="rollout", sampling=Sampling(max_new_tokens=64),
    )
    config = decode_request(message, tokenizer, LIMITS, MAX_MODEL_LEN, has_critic=True).config
    assert (config.gamma, config.lambd) == (0.0, pytest.approx(0.95))
    assert (config.kl.kl_target, config.kl.kl_horizon) == (pytest.approx(0.2), 50)
    assert config.reward.overlong_buffer_len == 16 and config.reward.max_new_tokens == 64
    assert config.reward.overlong_buffer_penalty_factor == 0.5 and config.reward.reward_clip == 5.0
    assert config.advantage.advantages_norm and config.advantage.advantage_clip == 2.0
    assert (config.dynamic_sampling.num_groups, config.dynamic_sampling.max_extra_rounds) == (2, 1)
    assert config.run_id == "run-7" and config.return_action_entropy and config.packing_samples
    assert config.return_packed and config.estimator.needs_critic
    assert config.normalization_scope == "rollout" and config.rollout_scope


def test_defaults_are_the_seeds(tokenizer):
    config = decode_request(_request(), tokenizer, LIMITS, MAX_MODEL_LEN).config
    assert (config.gamma, config.lambd, config.kl.kl_coef, config.kl.kl_target) == (1.0, 1.0, pytest.approx(0.01),
                                                                                      None)
    assert config.reward.overlong_buffer_len == 0 and config.dynamic_sampling is None
    assert not config.advantage.advantages_norm and config.advantage.advantage_clip == 0.0
    assert config.normalization_scope == "batch" and not config.rollout_scope


def test_reinforce_accepts_a_single_sample(tokenizer):
    decoded = decode_request(_request(advantage_estimator="reinforce", n_samples_per_prompt=1), tokenizer, LIMITS, MAX_MODEL_LEN)
    assert decoded.config.n_samples_per_prompt == 1


def test_unset_sampling_fields_take_defaults(tokenizer):
    message = _request()
    message.sampling.CopyFrom(generation_pb2.SamplingParams())
    sampling = decode_request(message, tokenizer, LIMITS, MAX_MODEL_LEN).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_new_tokens) == (1.0, 1.0, 0, 32)


class _HeldMaker:
    """An ExperienceMaker stand-in whose streams stay open until released."""

    has_critic = False

    def __init__(self):
        import asyncio

        self.release = asyncio.Event()

    def require_models_loaded(self, what):
        return None  # its (absent) models are never offloaded

    async def catch_up(self):
        return None  # one process: no other replica's versions to load

    async def make_experiences(self, request, deadline, stats, statistics=None):
        await self.release.wait()
        return
        yield


class _Context:
    def time_remaining(self):
        return 60.0

    def set_trailing_metadata(self, metadata):
        self.trailers = metadata


async def test_streams_beyond_max_concurrent_streams_get_resource_exhausted(tokenizer, tmp_path):
    import asyncio

    from services.common.errors import Overloaded
    from services.experience.api.servicer import ExperienceServicer
    from services.experience.runs.limits import OperatorLimits
    from services.experience.runs.registry import RunRegistry
    from services.experience.state.store import StateStore

    maker = _HeldMaker()
    from services.experience.fleet.readiness import GeneratorInfo

    info = GeneratorInfo("tiny", "hf", MAX_MODEL_LEN, policy_version=0)
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    store.migrate()
    runs = RunRegistry(OperatorLimits(), store)
    class Ready:  # the generator serves: what UpstreamMonitor answers once ready
        def require_ready(self):
            return info

        async def ready_info(self, wait_s):
            return info

    servicer = ExperienceServicer(maker, tokenizer, LIMITS, Ready(), runs, max_concurrent_streams=2,
                                  streams=MemoryStreams())
    held = [asyncio.create_task(anext(servicer.MakeExperiences(_request(), _Context()), None)) for _ in range(2)]
    async with asyncio.timeout(30):  # both streams are being served (decoding runs in a thread: no fixed sleep)
        while servicer._streams < 2:
            await asyncio.sleep(0.01)
    with pytest.raises(Overloaded, match="max_concurrent_streams"):
        await asyncio.wait_for(anext(servicer.MakeExperiences(_request(), _Context())), timeout=5)
    maker.release.set()
    await asyncio.gather(*held)
    assert await anext(servicer.MakeExperiences(_request(), _Context()), None) is None  # a slot is free again
    store.close()


def test_top_k_minus_one_is_off_as_in_the_seed_and_vllm(tokenizer):
    decoded = decode_request(_request(sampling=Sampling(top_k=-1)), tokenizer, LIMITS, MAX_MODEL_LEN)
    assert decoded.sampling.top_k == 0
    with pytest.raises(InvalidRequest, match="sampling.top_k"):
        decode_request(_wire("sampling.top_k", -2), tokenizer, LIMITS, MAX_MODEL_LEN)


def test_prompt_overflow_truncates_left_or_skips_and_keeps_the_message_indices(tokenizer):
    long_prompt, short = "one two three four five six seven eight nine ten", "hi"
    ids = tokenizer(long_prompt, add_special_tokens=False)["input_ids"]
    with pytest.raises(InvalidRequest) as info:  # reject (the default) names every such prompt
        decode_request(_request(prompts=[short, long_prompt, long_prompt], max_prompt_tokens=4), tokenizer, LIMITS,
                       MAX_MODEL_LEN)
    assert info.value.prompt_indices == [1, 2] and "limit is 4 prompt tokens" in str(info.value)
    truncated = decode_request(_request(prompts=[short, long_prompt], max_prompt_tokens=4,
                                        prompt_overflow="truncate_left"), tokenizer, LIMITS, MAX_MODEL_LEN)
    assert truncated.truncated_prompt_indices == (1,) and truncated.skipped_prompt_indices == ()
    assert truncated.prompts[1].token_ids == tuple(ids[-4:])  # the last 4 tokens: the end of the prompt is kept
    assert truncated.prompts[1].text == tokenizer.decode(ids[-4:]) == " seven eight nine ten"
    assert truncated.prompts[0].text == short and truncated.source_index(1) == 1
    skipped = decode_request(_request(prompts=[long_prompt, short, long_prompt, short], max_prompt_tokens=4,
                                      prompt_overflow="skip"), tokenizer, LIMITS, MAX_MODEL_LEN)
    assert [p.text for p in skipped.prompts] == [short, short]
    assert skipped.skipped_prompt_indices == (0, 2) and skipped.prompt_indices == (1, 3)
    assert [skipped.source_index(i) for i in range(2)] == [1, 3]


def test_rollout_correction_decodes_with_the_default_threshold(tokenizer):
    config = decode_request(_request(rollout_is="sequence"), tokenizer, LIMITS, MAX_MODEL_LEN).config
    assert config.rollout_correction.level == "sequence" and config.rollout_correction.threshold == 2.0
    config = decode_request(_request(rollout_is="token", rollout_is_threshold=5.0), tokenizer, LIMITS,
                            MAX_MODEL_LEN).config
    assert (config.rollout_correction.level, config.rollout_correction.threshold) == ("token", 5.0)
    assert decode_request(_request(), tokenizer, LIMITS, MAX_MODEL_LEN).config.rollout_correction is None


def test_the_sdks_agent_options_decode_into_the_services_agent(tokenizer):
    from fastexp import AgentOptions
    from services.experience.config import AgentOptions as DecodedAgent

    for sent, decoded in ((AgentOptions("calculator", max_calls=4), DecodedAgent("calculator", 4)),
                          (AgentOptions("calculator"), DecodedAgent("calculator", None))):
        message = _request(agent=sent)
        assert decode_request(message, tokenizer, LIMITS, MAX_MODEL_LEN).config.agent == decoded
