"""Where :meth:`RunGroups.find` looks for the scorer's own cgroups: each v1 hierarchy in the folder named as
``/proc/self/cgroup`` lists its controllers (``memory``; ``cpuacct`` alone or, as systemd mounts it, ``cpu,cpuacct``;
``pids``). Layouts written to a temporary folder: the same files the kernel shows, in other places."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from services.scorer.sandbox.cgroup import RunGroups
from services.scorer.sandbox.cgroup_v2 import UnifiedRunGroups, delegated, own_group


def _layout(tmp_path: Path, proc_cgroup: str, groups: dict[str, str]) -> tuple[Path, Path]:
    """``proc_cgroup`` as ``/proc/self/cgroup``; under a root, each folder of ``groups`` holding its probe file."""
    proc = tmp_path / "cgroup"
    proc.write_text(proc_cgroup)
    root = tmp_path / "fs"
    for folder, probe in groups.items():
        (root / folder).mkdir(parents=True)
        (root / folder / probe).write_text("0\n")
    return proc, root


@pytest.mark.parametrize("cpu_hierarchy", ["cpuacct", "cpu,cpuacct"])
def test_the_memory_and_cpuacct_groups_are_found_in_their_hierarchies(tmp_path, cpu_hierarchy):
    proc, root = _layout(tmp_path, f"9:pids:/\n4:memory:/pod/scorer\n2:{cpu_hierarchy}:/pod/scorer\n0::/\n",
                         {"memory/pod/scorer": "memory.limit_in_bytes",
                          f"{cpu_hierarchy}/pod/scorer": "cpuacct.usage"})
    groups = RunGroups.find(proc, root)
    assert groups == RunGroups(root / "memory/pod/scorer", root / cpu_hierarchy / "pod/scorer")


def test_without_a_cpuacct_hierarchy_runs_get_a_memory_group_alone(tmp_path):
    proc, root = _layout(tmp_path, "4:memory:/\n2:cpuacct:/\n", {"memory": "memory.limit_in_bytes"})
    assert RunGroups.find(proc, root) == RunGroups(root / "memory", None)


def test_without_a_memory_hierarchy_there_are_no_groups(tmp_path):
    # cgroup v2 alone (the one line "0::/..."), or v1 without memory: the sampled limits alone
    proc, root = _layout(tmp_path, "0::/system.slice/scorer.service\n", {"cpuacct": "cpuacct.usage"})
    assert RunGroups.find(proc, root) is None
    assert RunGroups.find(tmp_path / "no-such-file", root) is None


def test_a_group_whose_path_has_white_space_is_not_used(tmp_path):
    # the run's shell joins its groups by their paths, split on white space
    proc, root = _layout(tmp_path, "4:memory:/a b\n", {"memory/a b": "memory.limit_in_bytes"})
    assert RunGroups.find(proc, root) is None


def test_memory_and_cpuacct_in_one_hierarchy_make_one_group_per_run(tmp_path):
    # a host mounting both controllers together: the run's memory group counts its CPU; it is joined once
    proc, root = _layout(tmp_path, "3:cpuacct,memory:/scorer\n",
                         {"cpuacct,memory/scorer": "memory.limit_in_bytes"})
    (root / "cpuacct,memory/scorer/cpuacct.usage").write_text("0\n")
    groups = RunGroups.find(proc, root)
    assert groups == RunGroups(root / "cpuacct,memory/scorer", root / "cpuacct,memory/scorer")
    group = groups.create(1 << 20)  # (on plain folders: the files the kernel would have made are written here)
    assert group.cpu_path == group.path and group.procs == str(group.path / "cgroup.procs")
    assert (group.path / "memory.limit_in_bytes").read_text() == str(1 << 20)


def test_the_pids_group_is_found_in_its_hierarchy_its_root_included(tmp_path):
    # a hierarchy's root group has no pids.max (the kernel shows it in every group below): any group's cgroup.procs
    proc, root = _layout(tmp_path, "8:pids:/\n4:memory:/scorer\n2:cpuacct:/scorer\n",
                         {"memory/scorer": "memory.limit_in_bytes", "cpuacct/scorer": "cpuacct.usage",
                          "pids": "cgroup.procs"})
    groups = RunGroups.find(proc, root)
    assert groups == RunGroups(root / "memory/scorer", root / "cpuacct/scorer", root / "pids")


def test_without_a_pids_hierarchy_runs_get_no_pids_group(tmp_path):
    proc, root = _layout(tmp_path, "4:memory:/\n", {"memory": "memory.limit_in_bytes"})
    groups = RunGroups.find(proc, root)
    assert groups == RunGroups(root / "memory", None, None)
    assert groups.create(1 << 20, max_tasks=17).pids_path is None


def test_a_runs_pids_group_holds_max_tasks_and_is_joined_after_the_others(tmp_path):
    proc, root = _layout(tmp_path, "8:pids:/scorer\n4:memory:/scorer\n",
                         {"memory/scorer": "memory.limit_in_bytes", "pids/scorer": "cgroup.procs"})
    groups = RunGroups.find(proc, root)
    group = groups.create(1 << 20, max_tasks=17)
    assert group.pids_path == root / "pids/scorer" / group.path.name
    assert (group.pids_path / "pids.max").read_text() == "17"
    assert group.procs == f"{group.path / 'cgroup.procs'} {group.pids_path / 'cgroup.procs'}"
    # a gVisor run's: none (its host tasks are its kernel's, not the tool's)
    assert groups.create(1 << 20).pids_path is None
    assert [path.name for path in (root / "pids/scorer").glob("fastexp-run-*")] == [group.path.name]


def test_pids_and_memory_in_one_hierarchy_make_one_group_per_run(tmp_path):
    proc, root = _layout(tmp_path, "3:memory,pids:/scorer\n", {"memory,pids/scorer": "memory.limit_in_bytes"})
    (root / "memory,pids/scorer/cgroup.procs").write_text("")
    groups = RunGroups.find(proc, root)
    assert groups == RunGroups(root / "memory,pids/scorer", None, root / "memory,pids/scorer")
    group = groups.create(1 << 20, max_tasks=17)
    assert group.pids_path == group.path and group.procs == str(group.path / "cgroup.procs")
    assert (group.path / "pids.max").read_text() == "17"


def test_a_pids_group_that_cannot_be_made_leaves_the_run_its_other_groups(tmp_path, caplog):
    proc, root = _layout(tmp_path, "4:memory:/\n2:cpuacct:/\n", {"memory": "memory.limit_in_bytes",
                                                                  "cpuacct": "cpuacct.usage"})
    found = RunGroups.find(proc, root)
    assert found is not None
    groups = RunGroups(found.parent, found.cpu_parent, tmp_path / "no-such-hierarchy")  # its mkdir fails
    with caplog.at_level(logging.WARNING):
        group = groups.create(1 << 20, max_tasks=17)
    assert group.pids_path is None and group.path.is_dir() and group.cpu_path == root / "cpuacct" / group.path.name
    assert "no pids group for a tool run" in caplog.text


_MOUNTS = ("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
           "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")


@pytest.mark.parametrize(("proc_cgroup", "mount", "expected"), [
    # a hybrid host (this project's): v2 mounted beside the v1 hierarchies
    ("4:memory:/x\n0::/\n", "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
     "/sys/fs/cgroup/unified"),
    # a host of v2 alone, the scorer in a systemd unit
    ("0::/system.slice/scorer.service\n", "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n",
     "/sys/fs/cgroup/system.slice/scorer.service"),
    # a container whose mount is rooted at its own group (no cgroup namespace: the path is the host's)
    ("0::/kubepods/pod1/c1/scorer\n", "900 800 0:26 /kubepods/pod1/c1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
     "/sys/fs/cgroup/scorer"),
])
def test_the_unified_group_is_found_below_the_cgroup2_mount_that_holds_it(proc_cgroup, mount, expected):
    assert own_group(proc_cgroup, _MOUNTS + mount) == Path(expected)


@pytest.mark.parametrize(("proc_cgroup", "mount"), [
    ("4:memory:/x\n", "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"),  # no 0:: line
    ("0::/\n", ""),  # no cgroup2 mount
    ("0::/other/pod\n", "900 800 0:26 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"),  # not below it
    ("0::/my group\n", "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"),  # white space
])
def test_without_a_mount_holding_the_unified_group_there_is_none(proc_cgroup, mount):
    assert own_group(proc_cgroup, _MOUNTS + mount) is None


def test_a_unified_group_is_limited_by_the_controllers_it_hands_on(tmp_path):
    # the files the kernel shows in a run's group, where its parent hands memory, pids and hugetlb on: before Linux
    # 4.19 (no memory.oom.group) and without swap accounting (no memory.swap.max), then with both and huge pages
    groups = UnifiedRunGroups(tmp_path, frozenset({"memory", "pids", "hugetlb"}))
    assert groups._settings(tmp_path, 100, 9) == [("memory.max", "100"), ("pids.max", "9")]
    for name in ("memory.oom.group", "memory.swap.max", "hugetlb.2MB.max", "hugetlb.1GB.max"):
        (tmp_path / name).write_text("max\n")
    assert groups._settings(tmp_path, 100, None) == [("memory.max", "100"), ("memory.oom.group", "1"),
                                                     ("memory.swap.max", "0"), ("hugetlb.1GB.max", "0"),
                                                     ("hugetlb.2MB.max", "0")]
    assert UnifiedRunGroups(tmp_path)._settings(tmp_path, 100, 9) == []  # none handed on: kill and CPU alone


def test_a_group_is_delegated_where_marked_or_the_root_of_its_cgroup_namespace(tmp_path):
    group = tmp_path / "group"
    group.mkdir()
    assert not delegated(group, namespace_root=False)  # writable to root, nothing says it is the scorer's
    assert not delegated(group, namespace_root=True)  # seen as / but without cgroup.type: the hierarchy's real root
    (group / "cgroup.type").write_text("domain\n")
    assert delegated(group, namespace_root=True)  # a container's own subtree
    assert not delegated(group, namespace_root=False)
    try:
        os.setxattr(group, "user.delegate", b"1")  # as systemd marks a user service's delegated group
    except OSError as error:
        pytest.skip(f"this filesystem keeps no user xattrs: {error}")
    assert delegated(group, namespace_root=False)
