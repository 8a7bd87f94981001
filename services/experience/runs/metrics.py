"""Per-run gauges, read from each service's runs when Prometheus scrapes (no copy to keep in step, and a deleted
run's series vanish with it): ``fastexp_run_streams_open``, ``fastexp_run_policy_version`` (the live version its
streams sample: its adapter's for a LoRA run), ``fastexp_run_groups_in_flight`` and ``fastexp_run_groups_queued``
(its prompt groups generating, and waiting for the generator's fair share), each labelled ``run_id``. The samples
and tokens streamed to each run are counters in :mod:`services.common.metrics` (``fastexp_run_samples_total``,
``fastexp_run_tokens_total``).

One collector per process (:data:`RUN_METRICS`, in the default registry); each experience service adds what
reports its runs (:meth:`RunMetrics.add`), held weakly so a stopped service drops out.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class RunGauges:
    """One run's live values: streams open, live policy version, prompt groups generating and queued."""

    run_id: str
    streams_open: int
    policy_version: int
    groups_in_flight: int
    groups_queued: int


class RunsReport(Protocol):
    """What reports a service's runs (the experience servicer)."""

    def run_gauges(self) -> list[RunGauges]: ...


_GAUGES = (
    ("streams_open", "MakeExperiences streams open of a run"),
    ("policy_version", "The live policy version a run's streams sample (a LoRA run's: its adapter's)"),
    ("groups_in_flight", "A run's prompt groups generating now"),
    ("groups_queued", "A run's prompt groups waiting for their share of the generator"),
)


class RunMetrics(Collector):
    """The per-run gauges (module docs) of every service added."""

    def __init__(self) -> None:
        self._reports: weakref.WeakSet = weakref.WeakSet()

    def add(self, report: RunsReport) -> None:
        """Report ``report``'s runs from now on (until it is garbage)."""
        self._reports.add(report)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {name: GaugeMetricFamily(f"fastexp_run_{name}", doc, labels=["run_id"]) for name, doc in _GAUGES}
        for report in list(self._reports):
            for gauges in report.run_gauges():
                for name, family in families.items():
                    family.add_metric([gauges.run_id], getattr(gauges, name))
        yield from families.values()


#: The process's one per-run collector, in prometheus-client's default registry.
RUN_METRICS = RunMetrics()
REGISTRY.register(RUN_METRICS)
