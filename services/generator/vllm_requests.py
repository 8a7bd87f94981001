"""One sample as a vLLM request and its output as a :class:`~services.common.generation.CompletionRecord`: the
sampling parameters, the prompt's media, and the policy version of the weights that sampled it.

**Versions.** vLLM labels every step's tokens with the engine's weight version (``EngineCore.set_weight_version``;
a finished completion lists them as ``weight_versions`` spans). :class:`~services.generator.vllm_engine.VLLMEngine`
sets that label to the policy version inside each update's pause, after the load and before the requests it held
are added, so a record carries the version of the weights that sampled its tokens, whatever version the generator
reported when the request arrived (a request held by an update's pause runs on the new weights; one preempted
during the pause resumes on them: :func:`sampled_version`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fastexp.sampling import SamplingOptions
from services.common.generation import CompletionRecord
from services.common.media import DecodedMedia

logger = logging.getLogger(__name__)

#: vLLM's weight label before the first update: the generator's first policy version, 0.
INITIAL_WEIGHT_LABEL = "default"


def sampling_params(options: SamplingOptions, sample_index: int) -> Any:
    """vLLM ``SamplingParams`` of one sample: ``n=1``, seed ``seed + sample_index``, raw log-probs of the sampled
    token, FIRE's first-token temperature through the logits processor's extra argument."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from services.generator.vllm_logits import FIRST_TOKEN_TEMPERATURE

    return SamplingParams(
        n=1, temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
        max_tokens=options.max_new_tokens, min_tokens=options.min_new_tokens, ignore_eos=options.ignore_eos,
        skip_special_tokens=options.skip_special_tokens,
        seed=None if options.seed is None else options.seed + sample_index,
        logprobs=0,
        detokenize=False,  # decoded once at the end (to_record): per-step detokenizing costs the engine's CPU
        output_kind=RequestOutputKind.FINAL_ONLY,
        extra_args=None if options.first_token_temperature is None else {
            FIRST_TOKEN_TEMPERATURE: options.first_token_temperature},
    )


def multi_modal_data(media: DecodedMedia) -> dict[str, Any]:
    """vLLM's ``multi_modal_data`` for one prompt: PIL images and (T, H, W, 3) uint8 frame arrays, in order."""
    data: dict[str, Any] = {}
    if media.images:
        data["image"] = list(media.images)
    if media.videos:
        data["video"] = [v.frames for v in media.videos]
    return data


def sampled_version(output: Any, expected: int) -> int:
    """The policy version whose weights sampled ``output``'s tokens (a finished ``RequestOutput``), from vLLM's
    weight labels (module docs); ``expected`` (the version when the request arrived) where no token was sampled.

    Where the tokens came from two versions, the oldest, as for a multi-turn episode's turns (logged): ``AsyncLLM``'s
    pause waits for the requests it runs, not for one it preempted, which resumes on the new weights.
    """
    spans = output.outputs[0].weight_versions
    if spans is None:  # tokens no step labelled (every engine path labels them): the version at arrival
        if output.outputs[0].token_ids:
            logger.warning("request %s: vLLM labelled none of its tokens with a weight version", output.request_id)
        return expected
    versions = {0 if span.version == INITIAL_WEIGHT_LABEL else int(span.version) for span in spans}
    if not versions:
        return expected
    if len(versions) > 1:
        logger.warning("request %s was sampled by policy versions %s (preempted across an update): it carries %d",
                       output.request_id, sorted(versions), min(versions))
    return min(versions)


def to_record(
    output: Any, prompt_index: int, sample_index: int, prompt_ids: tuple[int, ...], version: int
) -> CompletionRecord:
    """The record of a finished ``RequestOutput`` (text left empty: the caller decodes it), carrying ``version``."""
    completion = output.outputs[0]
    token_ids = tuple(int(t) for t in completion.token_ids)
    log_probs = np.empty(len(token_ids), dtype=np.float32)
    for i, (token, candidates) in enumerate(zip(token_ids, completion.logprobs or [], strict=True)):
        log_probs[i] = candidates[token].logprob
    reason = completion.finish_reason
    return CompletionRecord(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_token_ids=prompt_ids,
        output_token_ids=token_ids,
        output_log_probs=log_probs,
        finish_reason="stop" if reason == "stop" else "abort" if reason == "abort" else "length",
        text=completion.text,
        policy_version=version,
    )
