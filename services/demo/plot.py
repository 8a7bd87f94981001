"""The demo's picture (``out/demo/demo.png``): rewards per prompt group, the advantage distribution, and when each
ExperienceBatch reached the trainer against the generator's progress."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from services.demo.job import Arrival


def plot_demo(
    rows: Sequence[dict],
    arrivals: Sequence[Arrival],
    generation: Sequence[tuple[float, float]],
    summary: dict,
    path: Path,
) -> None:
    """Write the three-panel figure to ``path`` (PNG).

    Args:
        rows: one dict per experience row with ``prompt_index``, ``reward``, ``advantage``.
        arrivals: each ExperienceBatch's arrival (seconds since the stream started) and row count.
        generation: ``(seconds, response tokens of finished samples)`` sampled from the generator's metrics.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rewards, advantages, timeline) = plt.subplots(1, 3, figsize=(16, 4.6))
    _rewards_per_group(rewards, rows)
    _advantage_histogram(advantages, rows, summary)
    _timeline(timeline, arrivals, generation, summary)
    figure.suptitle(
        f"fastexp demo: {summary['model']} on {summary['task']} ({summary['backend']} backend), "
        f"{summary['num_prompts']} prompts x {summary['n_samples_per_prompt']} samples, "
        f"reward mean {summary['reward_mean']:.3f}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _rewards_per_group(axis, rows: Sequence[dict]) -> None:
    groups: dict[int, list[float]] = {}
    for row in rows:
        groups.setdefault(row["prompt_index"], []).append(row["reward"])
    order = sorted(groups)
    means = [sum(groups[p]) / len(groups[p]) for p in order]
    axis.bar(range(len(order)), means, color="#9ecae1", label="group mean")
    for x, prompt in enumerate(order):
        axis.scatter([x] * len(groups[prompt]), groups[prompt], s=14, color="#08519c", zorder=3,
                     label="sample" if x == 0 else None)
    axis.set_xticks(range(len(order)), [str(p) for p in order], fontsize=7)
    axis.set_xlabel("prompt group (prompt index)")
    axis.set_ylabel("reward")
    axis.set_title("reward per group")
    axis.legend(fontsize=8, loc="upper right")


def _advantage_histogram(axis, rows: Sequence[dict], summary: dict) -> None:
    values = [row["advantage"] for row in rows]
    axis.hist(values, bins=25, color="#31a354")
    axis.set_xlabel("advantage (first action token)")
    axis.set_ylabel("rows")
    axis.set_title(f"advantages: {summary['rows_with_nonzero_advantage']:.0%} of rows, "
                   f"{summary['groups_with_nonzero_advantage']:.0%} of groups non-zero")


def _timeline(axis, arrivals: Sequence[Arrival], generation: Sequence[tuple[float, float]], summary: dict) -> None:
    total_rows = max(1, sum(a.rows for a in arrivals))
    delivered, times = 0, [0.0]
    fractions = [0.0]
    for arrival in arrivals:
        times += [arrival.at_s, arrival.at_s]
        fractions += [delivered / total_rows, (delivered + arrival.rows) / total_rows]
        delivered += arrival.rows
    axis.plot(times, fractions, color="#de2d26", label="experiences delivered (ExperienceBatch arrivals)")
    axis.scatter([a.at_s for a in arrivals], [0.0] * len(arrivals), marker="|", s=120, color="#de2d26")
    if generation:
        final = max(tokens for _, tokens in generation) or 1.0
        axis.plot([t for t, _ in generation], [tokens / final for _, tokens in generation], color="#3182bd",
                  label="generation: response tokens of finished samples")
    axis.set_xlabel("seconds since MakeExperiences was called")
    axis.set_ylabel("fraction of the run")
    axis.set_title(f"first batch at {summary['time_to_first_experience_s']:.1f} s, "
                   f"stream {summary['wall_time_s']:.1f} s")
    axis.legend(fontsize=8, loc="lower right")
