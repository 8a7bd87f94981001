"""Immutable records passed between the experience stages, and to trainers through the SDK.

Field names follow the seed's (LightRFT/OpenRLHF) ``Experience``; the seed's ``info`` dict is replaced by typed
fields. B rows, S padded sequence length, A padded response (action) length, ``S = max prompt length + A``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import torch

#: Wire dtype name -> torch dtype; only floating-point tensors are weights.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
}
#: Which model a weight update is for.
Target = Literal["policy", "critic"]


class VisionInputs(NamedTuple):
    """The vision inputs of B rows, concatenated in row order (the ExperienceBatch fields of the same names).

    Row i's images are ``image_grid_thw[sum(image_count[:i]) : sum(image_count[:i + 1])]`` and its patches the
    matching ``prod(grid)`` rows of ``pixel_values``; likewise for videos.

    Shape:
        pixel_values: (N_i, D) float32 or None when no row has images; image_grid_thw: (I, 3) int64;
        image_count: B ints; pixel_values_videos: (N_v, D) float32 or None; video_grid_thw: (V, 3) int64;
        video_count: B ints.
    """

    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor
    image_count: tuple[int, ...]
    pixel_values_videos: torch.Tensor | None
    video_grid_thw: torch.Tensor
    video_count: tuple[int, ...]

    def select(self, rows: slice) -> VisionInputs:
        """The inputs of ``rows`` (a contiguous slice of the B rows)."""
        image_grid, image_patches = _slice_items(self.image_grid_thw, self.image_count, rows)
        video_grid, video_patches = _slice_items(self.video_grid_thw, self.video_count, rows)
        return VisionInputs(
            pixel_values=None if self.pixel_values is None or image_patches.stop == image_patches.start
            else self.pixel_values[image_patches],
            image_grid_thw=image_grid,
            image_count=self.image_count[rows],
            pixel_values_videos=None if self.pixel_values_videos is None or video_patches.stop == video_patches.start
            else self.pixel_values_videos[video_patches],
            video_grid_thw=video_grid,
            video_count=self.video_count[rows],
        )


def _slice_items(grid: torch.Tensor, counts: Sequence[int], rows: slice) -> tuple[torch.Tensor, slice]:
    """Grid rows and patch-row range of the items belonging to ``rows``."""
    start, stop, _ = rows.indices(len(counts))
    first = sum(counts[:start])
    last = first + sum(counts[start:stop])
    patches = grid.prod(dim=1) if grid.numel() else torch.zeros(0, dtype=torch.int64)
    begin = int(patches[:first].sum())
    return grid[first:last], slice(begin, begin + int(patches[first:last].sum()))


class Rollout(NamedTuple):
    """Sampled sequences of whole prompt groups, padded: prompts on the left, responses on the right."""

    sequences: torch.Tensor  # (B, S) int64 token ids
    attention_mask: torch.Tensor  # (B, S) int64, 1 on real tokens
    action_mask: torch.Tensor  # (B, A) bool, true on sampled tokens (EOS included)
    response_length: torch.Tensor  # (B,) int64, tokens
    total_length: torch.Tensor  # (B,) int64, tokens
    prompt_index: tuple[int, ...]  # (B,) index into the request's prompts
    sample_index: tuple[int, ...]  # (B,) sample within the prompt's group
    prompt_texts: tuple[str, ...]  # (B,) prompts as fed to the policy
    response_texts: tuple[str, ...]  # (B,) detokenized responses
    policy_version: tuple[int, ...]  # (B,) weights version that sampled each row
    rollout_log_probs: torch.Tensor  # (B, A) float32, the generator's log-probs of the sampled tokens
    vision: VisionInputs | None = None  # the rows' images/videos (None: every row is text-only)
    repaired_vision_tokens: int = 0  # sampled placeholder tokens replaced by the pad token in `sequences`
    vision_prompt_mismatches: int = 0  # rows whose generator prompt ids differed from the processor's
    num_turns: tuple[int, ...] = ()  # (B,) model turns per row (multi-turn episodes; 1 otherwise)


class Experience(NamedTuple):
    """One batch of RL experience, ready for a policy-gradient step."""

    sequences: torch.Tensor  # (B, S) int64
    attention_mask: torch.Tensor  # (B, S) int64
    action_mask: torch.Tensor  # (B, A) bool
    action_log_probs: torch.Tensor  # (B, A) float32, actor log-probs (nats)
    base_action_log_probs: torch.Tensor | None  # (B, A) float32, reference log-probs (nats); None: no reference
    values: torch.Tensor | None  # (B, A) float32 critic values, None without a critic
    returns: torch.Tensor  # (B, A) float32
    advantages: torch.Tensor  # (B, A) float32
    kl: torch.Tensor | None  # (B, A) float32, per-token KL estimate (nats), 0 on padding; None: no reference
    reward: torch.Tensor  # (B,) float32, scorer reward before shaping
    response_length: torch.Tensor  # (B,) int64
    total_length: torch.Tensor  # (B,) int64
    prompt_index: tuple[int, ...]
    sample_index: tuple[int, ...]
    prompt_texts: tuple[str, ...]
    response_texts: tuple[str, ...]
    policy_version: tuple[int, ...]
    reward_metrics: dict[str, torch.Tensor]  # name -> (B,) float32
    kl_coef: float  # beta used in this batch's rewards
    batch_index: int  # 0, 1, ... in stream order
    rollout_log_probs: torch.Tensor  # (B, A) float32, the generator's log-probs of the sampled tokens
    shaped_reward: torch.Tensor  # (B,) float32, the scalar placed at each row's last response token
    action_entropy: torch.Tensor | None = None  # (B, A) float32 actor entropy (nats), on request
    packed_seq_lens: torch.Tensor | None = None  # (B,) int64 in the packed layout, None when padded
    reward_clip_frac: float = 0.0  # fraction of rows reward_clip changed
    advantage_clip_frac: float = 0.0  # fraction of action tokens advantage_clip changed
    reward_norm_mean: float = 0.0  # running mean subtracted (reward_running_norm_minus_mean)
    reward_norm_std: float = 1.0  # running std divided by (reward_running_norm)
    dropped_prompt_indices: tuple[int, ...] = ()  # dynamic sampling drops since the previous batch
    actor_policy_version: int = 0  # policy version of the actor replica that computed action_log_probs
    resampled_groups: int = 0  # groups resampled since the previous batch (too stale, or aborted by an update)
    vision: VisionInputs | None = None  # pixel patches and grids of the rows' images/videos, in row order
    repaired_vision_tokens: int = 0  # sampled placeholder tokens replaced by the pad token (vision.repair_placeholders)
    num_turns: tuple[int, ...] = ()  # (B,) model turns per row: the maximal runs of action_mask (see turn_spans)
    rollout_is_weights: torch.Tensor | None = None  # (B, A) float32 truncated IS weights (rollout_correction)
    rollout_log_prob_abs_diff: float = 0.0  # mean |action_log_probs - rollout_log_probs| per action token, nats
    rollout_kl: float = 0.0  # KL(rollout || actor) per action token (k3), nats
    rollout_is_clip_frac: float = 0.0  # share of tokens (token level) or rows (sequence level) truncated

    @property
    def info(self) -> Mapping[str, torch.Tensor | Mapping[str, torch.Tensor]]:
        """The seed's ``experience.info`` (LightRFT/OpenRLHF), read-only and computed from the typed fields; every
        value is (B,) float32 (batch-wide figures repeated per row, so ``torch.cat`` over batches works as there).

        Keys: ``reward`` (the scorer's, before shaping), ``response_length``, ``total_length`` (tokens), ``kl``
        (per-row mean of ``kl`` over ``action_mask``, 0 without a reference), ``return`` (the return at the first
        response token, ``returns[:, 0]``: the sum of the per-token rewards, the seed's ``final_reward.sum(-1)``, when
        gamma = 1 and the estimator is not gae, whose returns are advantages + values),
        ``reward_clip_frac``, ``advantage_clip_frac``, ``rollout_is_clip_frac``, and ``reward_metrics``
        (name -> (B,)). Only padded batches (``unpack_experience`` a packed one first).

        Raises:
            ValueError: a packed batch.
        """
        if self.packed_seq_lens is not None:
            raise ValueError("info needs the padded layout: unpack_experience(batch) first")
        rows = self.reward.shape[0]
        mask = self.action_mask.float()
        kl = torch.zeros(rows) if self.kl is None else (self.kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        per_batch = {name: torch.full((rows,), float(getattr(self, name)))
                     for name in ("reward_clip_frac", "advantage_clip_frac", "rollout_is_clip_frac")}
        return MappingProxyType({
            "reward": self.reward.float(),
            "response_length": self.response_length.float(),
            "total_length": self.total_length.float(),
            "kl": kl.float(),
            "return": self.returns[:, 0].float() if self.returns.shape[1] else torch.zeros(rows),
            **per_batch,
            "reward_metrics": MappingProxyType(dict(self.reward_metrics)),
        })

    def to_device(self, device: torch.device | str) -> Experience:
        """The same batch with every tensor on ``device`` (the seed's ``to_device``, which moves in place; a new
        record here, the fields are immutable)."""
        return self._map_tensors(lambda tensor: tensor.to(device))

    def pin_memory(self) -> Experience:
        """The same batch with every tensor in page-locked host memory, for asynchronous copies to an accelerator
        (the seed's ``pin_memory``). Without an accelerator there is nothing to pin for: the batch is returned as
        it is."""
        if not torch.cuda.is_available():
            return self
        return self._map_tensors(lambda tensor: tensor.pin_memory())

    def _map_tensors(self, function: Callable[[torch.Tensor], torch.Tensor]) -> Experience:
        return Experience(*(_map_tensors(value, function) for value in self))


def _map_tensors(value: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``function`` applied to its tensors (a tensor, a dict of them, VisionInputs; others as is)."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, function) for key, item in value.items()}
    if isinstance(value, VisionInputs):
        return VisionInputs(*(_map_tensors(item, function) for item in value))
    return value


class ForwardOutputs(NamedTuple):
    """What the actor, reference and critic forward passes produce for a Rollout, each (B, A) float32."""

    action_log_probs: torch.Tensor  # actor log-probs (nats)
    base_action_log_probs: torch.Tensor | None  # reference log-probs (nats); None when no reference ran
    values: torch.Tensor | None = None  # critic values, when a critic runs
    action_entropy: torch.Tensor | None = None  # actor entropy (nats), on request


def turn_spans(action_mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """The model turns of one row as ``[start, end)`` action positions: the maximal runs of ``action_mask`` true
    (in a multi-turn episode the observations between turns are false; single-turn rows have one span).

    Shape:
        action_mask_row: (A,) bool, one row of ``Experience.action_mask`` (padded layout).
    """
    spans, start = [], None
    for position, on in enumerate(action_mask_row.tolist()):
        if on and start is None:
            start = position
        elif not on and start is not None:
            spans.append((start, position))
            start = None
    if start is not None:
        spans.append((start, len(action_mask_row)))
    return spans
