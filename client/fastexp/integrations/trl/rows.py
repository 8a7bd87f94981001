"""The pure pieces of the TRL integration: runs of repeated prompts, an Experience's rows in TRL's terms, the
policy's weights under checkpoint names, references looked up by prompt.

Notation: B rows, P a row's prompt tokens, C its completion tokens (a multi-turn episode's completion holds its
model turns and the environment's observations between them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from fastexp.request import PromptLike
from fastexp.types import Experience


def prompt_runs(prompts: Sequence[PromptLike]) -> list[tuple[int, int]]:
    """The maximal runs of equal consecutive prompts as ``(start, length)``, in order.

    TRL's ``RepeatSampler`` repeats each prompt ``num_generations`` times in a row, so each run is one GRPO group
    (a process's slice may cut a group at its ends: those runs are shorter). Equal prompts that are not adjacent
    are different groups.

    Example: ``["a", "a", "b", "b", "a"]`` -> ``[(0, 2), (2, 2), (4, 1)]``.
    """
    runs: list[tuple[int, int]] = []
    for index, prompt in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == prompt:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


class RolloutRow(NamedTuple):
    """One row of an Experience, unpadded, in TRL's terms (token ids, not text).

    Shape: ``prompt_ids`` (P,) ints, the prompt as the service rendered it (chat template applied);
    ``completion_ids`` (C,) ints, EOS included when sampled; ``logprobs`` (C,) floats, the generator's log-probs of
    the sampled tokens in nats (0 on observation tokens); ``env_mask`` (C,) ints, 1 on tokens the model sampled,
    0 on the environment's observations (all 1 for single-turn rows).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    reward: float  # the scorer's reward, before any shaping
    reward_metrics: dict[str, float]  # the scorer's per-source metrics of this row
    policy_version: int  # version of the weights that sampled it
    advantage: float  # fastexp's advantage at the row's first sampled token (0 when it sampled none)
    response_text: str
    prompt_index: int  # index into the request's prompts
    sample_index: int  # sample within the prompt's group


def experience_rows(experience: Experience) -> list[RolloutRow]:
    """The B rows of a padded Experience (``sequences`` (B, S) with prompts left-padded to ``S - A`` and responses
    right-padded to A, ``action_mask`` (B, A)) as :class:`RolloutRow` s, in row order.

    Raises:
        ValueError: a packed Experience (request ``return_packed=False``).
    """
    if experience.packed_seq_lens is not None:
        raise ValueError("experience_rows needs the padded layout (request return_packed=False)")
    width = experience.sequences.shape[1] - experience.action_mask.shape[1]  # S - A: the padded prompt width
    rows = []
    for r in range(experience.sequences.shape[0]):
        length = int(experience.response_length[r])
        real_prompt = experience.attention_mask[r, :width].bool()
        action = experience.action_mask[r, :length]
        advantages = experience.advantages[r, :length][action]
        rows.append(RolloutRow(
            prompt_ids=experience.sequences[r, :width][real_prompt].tolist(),
            completion_ids=experience.sequences[r, width : width + length].tolist(),
            logprobs=torch.where(action, experience.rollout_log_probs[r, :length], 0.0).tolist(),
            env_mask=action.to(torch.int64).tolist(),
            reward=float(experience.reward[r]),
            reward_metrics={name: float(values[r]) for name, values in experience.reward_metrics.items()},
            policy_version=int(experience.policy_version[r]),
            advantage=float(advantages[0]) if advantages.numel() else 0.0,
            response_text=experience.response_texts[r],
            prompt_index=experience.prompt_index[r],
            sample_index=experience.sample_index[r],
        ))
    return rows


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``model`` that training changes, under the base checkpoint's names, for ``UpdateWeights``.

    A PEFT LoRA model: each adapted layer's merged weight ``W + (alpha / r) B A`` (every active adapter), named
    as in the base checkpoint (``model.layers.0.self_attn.q_proj.weight``), and the ``modules_to_save`` copies;
    the frozen rest never changes and is not sent. Any other model: its trainable parameters (a DDP ``module.``
    prefix removed). Tensors keep the trainer's dtype (the services cast them to their own).

    Raises:
        NotImplementedError: a PEFT model without LoRA layers (other adapter types cannot be merged here).
    """
    if hasattr(model, "peft_config"):
        yield from _merged_lora_weights(model)
        return
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            yield _checkpoint_name(name), parameter.detach()


def _merged_lora_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from peft.tuners.lora import LoraLayer

    found = False
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                found = True
                weight = module.get_base_layer().weight
                if not module.merged:  # merged adapters are in the base weight already
                    for adapter in module.active_adapters:
                        if adapter in module.lora_A:
                            weight = weight + module.get_delta_weight(adapter)
                yield f"{_checkpoint_name(name)}.weight", weight.detach()
        for name, parameter in model.named_parameters():
            if ".modules_to_save." in name and parameter.requires_grad:
                yield _checkpoint_name(name), parameter.detach()
    if not found:
        raise NotImplementedError("policy_weights merges LoRA adapters only; this PEFT model has no LoRA layer")


def _checkpoint_name(name: str) -> str:
    """A parameter's name in the base checkpoint: without DDP's ``module.``, gradient checkpointing's wrapper,
    PEFT's ``base_model.model.`` / ``.base_layer`` and ``modules_to_save.<adapter>.``."""
    name = name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if ".modules_to_save." in name:
        head, _, tail = name.partition(".modules_to_save.")
        name = f"{head}.{tail.partition('.')[2]}"
    return name


class ReferenceTable:
    """References and labels of a dataset's rows, looked up by prompt (TRL hands a rollout function only prompts).

    ``dataset``: rows as mappings (a ``datasets.Dataset``, a list of dicts) with a ``prompt_column`` (text or chat
    messages), and optionally ``reference_column`` and ``label_column`` (values sent as text). A prompt that occurs
    in several rows takes the first row's.
    """

    def __init__(self, dataset: Iterable[Mapping[str, Any]], *, prompt_column: str = "prompt",
                 reference_column: str | None = "answer", label_column: str | None = None) -> None:
        self._rows: dict[str, tuple[str | None, str | None]] = {}
        self.reference_column, self.label_column = reference_column, label_column
        for row in dataset:
            reference = row.get(reference_column) if reference_column else None
            label = row.get(label_column) if label_column else None
            self._rows.setdefault(_prompt_key(row[prompt_column]), (
                None if reference is None else str(reference), None if label is None else str(label)))

    def columns(self, prompts: Sequence[PromptLike]) -> dict[str, list[str] | None]:
        """``references`` and ``labels`` for ``prompts`` (``None`` for a column the table does not have), as
        :meth:`ExperienceClient.make_experiences` takes them.

        Raises:
            KeyError: a prompt that is in none of the dataset's rows.
        """
        found = []
        for prompt in prompts:
            key = _prompt_key(prompt)
            if key not in self._rows:
                raise KeyError(f"prompt not in the rollout's dataset (pass the dataset it comes from): {key[:200]}")
            found.append(self._rows[key])
        return {
            "references": [r or "" for r, _ in found] if self.reference_column else None,
            "labels": [label or "" for _, label in found] if self.label_column else None,
        }


def _prompt_key(prompt: PromptLike) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(list(prompt), sort_keys=True, ensure_ascii=False)
