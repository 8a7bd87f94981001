"""Immutable records passed between the experience stages, and to trainers through the SDK.

Field names follow the seed's (LightRFT/OpenRLHF) ``Experience``; the seed's ``info`` dict is replaced by typed
fields. B rows, S padded sequence length, A padded response (action) length, ``S = max prompt length + A``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


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
