"""Which cgroup a tool run gets: cgroup v1's (:mod:`.cgroup`) or v2's (:mod:`.cgroup_v2`), by the scorer's
``sandbox.cgroups`` setting and what the host lets the scorer write."""

from __future__ import annotations

from typing import Literal

from services.scorer.sandbox.cgroup import RunGroup, RunGroups
from services.scorer.sandbox.cgroup_v2 import UnifiedRunGroup, UnifiedRunGroups

#: ``auto``: cgroup v1's where its memory controller is writable (a hybrid host's, where v2 has no memory controller),
#: else v2's where the scorer's group is delegated to it (:func:`.cgroup_v2.delegated`); ``v1``: v1's or none;
#: ``v2``: v2's wherever the scorer's group is writable, delegated or not; ``off``: none (the sampled limits alone).
CgroupVersion = Literal["auto", "v1", "v2", "off"]
#: The groups of the scorer below which runs get theirs, either hierarchy.
AnyRunGroups = RunGroups | UnifiedRunGroups
#: One run's group(s), either hierarchy: the same reading interface (``procs``, ``cpu_s``, ``oom_kills``, ``end``).
AnyRunGroup = RunGroup | UnifiedRunGroup


def find_run_groups(version: CgroupVersion = "auto") -> AnyRunGroups | None:
    """The scorer's groups below which each run gets its own (:data:`CgroupVersion`); None: none the host lets the
    scorer make, or ``off``. A v2 group may move the scorer's processes into a leaf (:mod:`.cgroup_v2`)."""
    if version == "off":
        return None
    if version in ("auto", "v1") and (groups := RunGroups.find()) is not None:
        return groups
    if version == "auto":  # a group writable but not delegated (a root scorer's, a unit's without Delegate=yes)
        return UnifiedRunGroups.find(delegated_only=True)  # is systemd's or another's to divide: not ours
    return UnifiedRunGroups.find() if version == "v2" else None


def describe(groups: AnyRunGroups | None) -> str:
    """Which group each run gets, in a phrase for the start-up log and the sandbox's health (e.g. ``cgroup v2 group
    per run (hugetlb)``)."""
    if groups is None:
        return "no cgroup per run: limits sampled"
    if isinstance(groups, UnifiedRunGroups):
        return f"cgroup v2 group per run ({', '.join(sorted(groups.controllers)) or 'no controller'})"
    held = [name for name, parent in (("memory", groups.parent), ("cpuacct", groups.cpu_parent),
                                      ("pids", groups.pids_parent)) if parent is not None]
    return f"cgroup v1 groups per run ({', '.join(held)})"
