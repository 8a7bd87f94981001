"""Summarize a py-spy raw profile (``py-spy record --subprocesses --format raw``) of ``make demo``: per process, the
CPU seconds sampled, the functions that spend them (self time) and fastexp's own functions by inclusive time.

``make profile`` records and runs this; the top costs go into ``benchmarks/README.md``. Idle threads are not
sampled (py-spy's default), so the seconds are time on a CPU, per process.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Annotated

import typer

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^():]+)(?::\d+)?\)$")
OURS = ("/services/", "/fastexp/", "/benchmarks/")


def _frame_name(frame: str) -> str:
    match = _FRAME.match(frame)
    if not match:
        return frame
    path = match["file"]
    for marker in (*OURS, "/site-packages/"):
        if marker in path:
            path = path[path.index(marker) + 1 :].removeprefix("site-packages/")
            break
    return f"{match['function']} ({path})"


def _process_name(headers: list[str]) -> str:
    """Name the innermost of a stack's ``process PID:"command"`` frames (py-spy nests a child's under its
    parent's): a service by its name, a spawned child by its parent service."""
    names = []
    for header in headers:
        command = header.split(":", 1)[-1].strip('"')
        if "services.cli serve" in command:
            names.append("service " + command.split("services.cli serve", 1)[1].split()[0])
        elif "multiprocessing" in command or "spawn_main" in command:
            names.append("child process")
        else:
            names.append(command[:80])
    if len(names) > 1 and names[-1] == "child process":
        return f"{names[-2]}: child process"
    return names[-1]


def summarize(raw: Path, rate: int, top: int = 8) -> str:
    """Markdown: processes by CPU seconds, then each busy process's top self and fastexp-inclusive functions."""
    own: dict[str, Counter] = defaultdict(Counter)
    inclusive: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or not stack.startswith("process "):
            continue
        parts = stack.split(";")
        depth = next((i for i, part in enumerate(parts) if not part.startswith("process ")), len(parts))
        headers, frames = parts[:depth], parts[depth:]
        process, samples = _process_name(headers), int(count)
        totals[process] += samples
        names = [_frame_name(f) for f in frames]
        if names:
            own[process][names[-1]] += samples
        for name in set(names):
            if any(marker.strip("/") + "/" in name for marker in OURS):
                inclusive[process][name] += samples
    grand = sum(totals.values()) or 1
    lines = ["| process | CPU s | share |", "|---|---|---|"]
    lines += [f"| {p} | {n / rate:.1f} | {n / grand:.0%} |" for p, n in totals.most_common()]
    for process, samples in totals.most_common():
        if samples / grand < 0.02:
            continue
        lines += ["", f"### {process}: {samples / rate:.1f} CPU s", "", "| self time | s | share |", "|---|---|---|"]
        lines += [f"| `{f}` | {n / rate:.1f} | {n / samples:.0%} |" for f, n in own[process].most_common(top)]
        if inclusive[process]:
            lines += ["", "| fastexp function, inclusive | s | share |", "|---|---|---|"]
            lines += [f"| `{f}` | {n / rate:.1f} | {n / samples:.0%} |" for f, n in inclusive[process].most_common(top)]
    return "\n".join(lines) + "\n"


def main(
    raw: Annotated[Path, typer.Argument(help="py-spy --format raw output")],
    rate: Annotated[int, typer.Option(help="the sampling rate py-spy recorded at (samples/s)")] = 50,
    out: Annotated[Path | None, typer.Option(help="also write the markdown here")] = None,
) -> None:
    report = summarize(raw, rate)
    if out is not None:
        out.write_text(report)
    print(report)


if __name__ == "__main__":
    typer.run(main)
