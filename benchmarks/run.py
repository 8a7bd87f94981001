"""``make bench``: run every benchmark, print a table with the machine, write ``out/bench/results.json``.

``--small`` runs tiny sizes as a quick smoke test of the benchmark code; its figures are not measurements.
(The test suite's smoke test calls ``benchmarks.gae.run`` with tiny sizes directly, without thresholds.)
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from benchmarks import gae, packing
from services.common.models import SMOLLM2_ALIAS, resolve_model

TARGETS = {"gae_vectorized_speedup": ">= 10", "gae_max_abs_error": "<= 1e-5", "packing_forward_speedup": "> 1"}


def main(
    out: Annotated[Path, typer.Option(help="results folder")] = Path("out/bench"),
    small: Annotated[bool, typer.Option(help="tiny sizes: a smoke test, not a measurement")] = False,
) -> None:
    results: dict[str, object] = {
        "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "device": "cpu"},
        "small": small,
    }
    results.update(gae.run(batch=8, length=256, repeats=1) if small else gae.run())
    model = resolve_model(SMOLLM2_ALIAS)
    results.update(
        packing.run(model, rows=4, max_response=16, micro_batch_size=2, repeats=1) if small else packing.run(model)
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = Table(title=f"fastexp benchmarks ({'smoke' if small else 'full'}) on {results['machine']}")
    for column in ("figure", "value", "target"):
        table.add_column(column)
    for key, value in results.items():
        if key in ("machine", "small"):
            continue
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value), TARGETS.get(key, ""))
    (out / "results.md").write_text(_markdown(results))
    Console().print(table)


def _markdown(results: dict) -> str:
    lines = [f"machine: {results['machine']}", "", "| figure | value | target |", "|---|---|---|"]
    for key, value in results.items():
        if key not in ("machine", "small"):
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(f"| {key} | {shown} | {TARGETS.get(key, '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    typer.run(main)
