"""A bubblewrap run's group in cgroup v2's unified hierarchy (``sandbox.cgroups: v2``), in a group delegated to the
scorer as systemd's ``Delegate=yes`` or a container's own cgroup namespace delegates one: a group holding the scorer's
process, with a controller (``hugetlb``, the one this project's hybrid hosts have in v2) it may hand to its children.

Checked for real, here: the scorer moves its group's processes into a leaf so that the controller can be handed on
(v2's no-internal-process rule) and each run's group gets its limit; a cancelled run's whole tree, detached sessions
included, is killed as one (``cgroup.kill``) and its group removed; the CPU of children the kernel reaps counts toward
``cpu_s`` (``cpu.stat``, kept for every group); leftover groups are swept. The memory and task limits need v2's
``memory`` and ``pids`` controllers delegated, which a host binding them to v1 (this project's) cannot give: those
tests run where the scorer's group has them."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.scorer.sandbox import SandboxLimits
from services.scorer.sandbox.bubblewrap import BubblewrapOptions, BubblewrapSandbox
from services.scorer.sandbox.cgroup_v2 import CONTROLLERS, LEAF, UnifiedRunGroup, UnifiedRunGroups, own_group
from services.scorer.sandbox.gvisor import GvisorSandbox
from services.scorer.sandbox.settings import SandboxSettings, build_sandbox
from tests.support.sandbox_programs import BURST, REAPED_BY_THE_KERNEL, THREADS

_HOME = own_group(Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text())
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or _HOME is None or not (_HOME / "cgroup.subtree_control").is_file(),
    reason="needs a root scorer and a cgroup v2 (unified) hierarchy mounted writable")


#: Held while a module's groups exist (:func:`delegated`).
LOCK = "/tmp/fastexp-unified-groups-test.lock"


def _procs(group: Path) -> list[str]:
    with contextlib.suppress(OSError):
        return (group / "cgroup.procs").read_text().split()
    return []


@pytest.fixture(scope="module")
def delegated() -> Iterator[Path]:
    """A group of its own below this process's, holding this process, that has the controllers of
    :data:`CONTROLLERS` this process's group has to hand on (enabled there where they are not yet, and disabled
    again after: ``hugetlb`` on this project's hosts); afterwards this process moves back, whatever is left in the
    group is killed, and the groups go. One such module at a time on a host (a lock): another's ``-hugetlb`` would
    fail, or pull the controller from under this one's groups."""
    assert _HOME is not None
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        handed = (_HOME / "cgroup.subtree_control").read_text().split()
        enabled = []
        try:
            for controller in CONTROLLERS:
                if controller not in handed and controller in (_HOME / "cgroup.controllers").read_text().split():
                    with contextlib.suppress(OSError):  # (a group of this process's holding processes: v2 refuses)
                        (_HOME / "cgroup.subtree_control").write_text(f"+{controller}")
                        enabled.append(controller)
            if "hugetlb" not in (_HOME / "cgroup.subtree_control").read_text().split():
                pytest.skip(f"{_HOME} has no hugetlb controller to hand on")
            scratch = _HOME / f"fastexp-test-{uuid.uuid4().hex[:12]}"
            scratch.mkdir()
            try:
                (scratch / "cgroup.procs").write_text(str(os.getpid()))
                yield scratch
            finally:
                _dismantle(scratch)
        finally:
            for controller in enabled:
                with contextlib.suppress(OSError):  # (reported by the check below, not hidden behind this one)
                    (_HOME / "cgroup.subtree_control").write_text(f"-{controller}")
            left = set(enabled) & set((_HOME / "cgroup.subtree_control").read_text().split())
            assert not left, f"{left} still handed on from {_HOME}"


def _dismantle(scratch: Path) -> None:
    """Move this process back to its group, kill whatever is left below ``scratch`` (the event: ``populated 0``) and
    remove the groups, deepest first."""
    assert _HOME is not None
    (_HOME / "cgroup.procs").write_text(str(os.getpid()))
    (scratch / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 30
    while UnifiedRunGroup(scratch).populated() and time.monotonic() < deadline:
        time.sleep(0.01)
    for folder, _, _ in sorted(os.walk(scratch), key=lambda walked: -walked[0].count("/")):
        with contextlib.suppress(OSError):
            Path(folder).rmdir()
    assert not scratch.exists(), f"{scratch} could not be removed"


def _recording(sandbox: BubblewrapSandbox | GvisorSandbox) -> list[Path]:
    """The folders of the groups ``sandbox`` makes from now on."""
    made: list[Path] = []
    groups = sandbox._groups
    assert isinstance(groups, UnifiedRunGroups)

    class Recorded(UnifiedRunGroups):
        def create(self, limit_bytes: int, max_tasks: int | None = None) -> UnifiedRunGroup:
            group = super().create(limit_bytes, max_tasks)
            made.append(group.path)
            return group

    sandbox._groups = Recorded(groups.parent, groups.controllers)
    return made


def _running(pid: str) -> bool:
    """Whether ``pid`` still runs (a zombie has ended: its parent has yet to read its status)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


#: Three children, each in a session of its own, and the tool itself, sleeping until killed.
DETACHED = textwrap.dedent("""
    import os, time
    for _ in range(3):
        if os.fork() == 0:
            os.setsid()
            time.sleep(600)
    time.sleep(600)
""")


async def test_the_scorers_group_hands_its_controllers_on_from_a_leaf_and_a_cancelled_run_leaves_nothing(delegated):
    sandbox = BubblewrapSandbox(BubblewrapOptions(cgroups="v2"))
    groups = sandbox._groups
    assert isinstance(groups, UnifiedRunGroups) and groups.parent == delegated
    assert "hugetlb" in groups.controllers
    assert "hugetlb" in (delegated / "cgroup.subtree_control").read_text().split()
    unified = next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    assert unified.endswith(f"/{delegated.name}/{LEAF}")
    assert not _procs(delegated)  # no internal process: this one moved into the leaf
    again = BubblewrapSandbox(BubblewrapOptions(cgroups="v2"))._groups  # another backend of the scorer (a reload)
    assert again == groups and not (delegated / LEAF / LEAF).exists()

    made = _recording(sandbox)
    call = asyncio.ensure_future(sandbox.run(DETACHED, SandboxLimits(timeout_s=300.0)))
    try:
        # the event: the whole tree is in the run's group (bwrap's monitor, the tool and its three children)
        async with asyncio.timeout(60):
            while not (made and len(_procs(made[0])) >= 2 + 3):
                await asyncio.sleep(0.01)
        tree = _procs(made[0])
        limits = {path.name: path.read_text().strip() for path in made[0].glob("hugetlb.*.max")}
        assert limits and set(limits.values()) == {"0"}, limits  # no huge page: memory.max would not count it
        assert made[0].parent == delegated and not (delegated / LEAF / made[0].name).exists()
    finally:
        call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not made[0].exists()
    assert not [pid for pid in tree if _running(pid)], tree  # killed as one: the detached sessions too

    benign = await sandbox.run("print(sum(range(10)))", SandboxLimits(timeout_s=30.0))
    assert benign.stdout.strip() == "45" and not benign.stopped and len(made) == 2 and not made[1].exists()




async def test_cpu_of_children_the_kernel_reaps_counts_toward_cpu_s(delegated):
    sandbox = BubblewrapSandbox(BubblewrapOptions(cgroups="v2"))
    made = _recording(sandbox)
    result = await sandbox.run(REAPED_BY_THE_KERNEL, SandboxLimits(timeout_s=120.0, cpu_s=2))
    assert result.stopped == "cpu" and "CPU time limit" in result.as_observation(), result
    assert "done" not in result.stdout
    assert len(made) == 1 and not made[0].exists()


def test_auto_takes_a_v2_group_only_where_it_is_delegated(delegated):
    # a root scorer can write this group, but nobody delegated it (as a systemd unit's without Delegate=yes): auto
    # leaves it alone; marked as systemd marks a delegated unit's group, auto takes it
    assert UnifiedRunGroups.find(delegated_only=True) is None
    os.setxattr(delegated, "trusted.delegate", b"1")
    try:
        groups = UnifiedRunGroups.find(delegated_only=True)
        assert groups is not None and groups.parent == delegated and "hugetlb" in groups.controllers
    finally:
        os.removexattr(delegated, "trusted.delegate")


def test_leftover_groups_are_swept_and_live_ones_kept(delegated):
    groups = UnifiedRunGroups.find()
    assert groups is not None and groups.parent == delegated
    left, live = groups.create(64 << 20), groups.create(64 << 20)
    an_hour_ago = time.time() - 3600  # a scorer that crashed an hour ago left them; one still holds a process
    for group in (left, live):
        os.utime(group.path, (an_hour_ago, an_hour_ago))
    (live.path / "cgroup.procs").write_text(str(os.getpid()))
    try:
        assert groups.sweep() >= 1 and not left.path.exists() and live.path.exists()
    finally:
        (delegated / LEAF / "cgroup.procs").write_text(str(os.getpid()))
        live.remove()
    assert not live.path.exists()




def _has(controller: str) -> bool:
    return _HOME is not None and controller in (_HOME / "cgroup.controllers").read_text().split()


@pytest.mark.skipif(not _has("memory"), reason="needs cgroup v2's memory controller delegated")
async def test_a_burst_between_two_samples_meets_the_runs_memory_max(delegated):
    sandbox = BubblewrapSandbox(BubblewrapOptions(cgroups="v2", tmpfs_bytes=16 << 20, usage_poll_s=5.0))
    assert sandbox._groups is not None and "memory" in sandbox._groups.controllers
    made = _recording(sandbox)
    result = await sandbox.run(BURST, SandboxLimits(timeout_s=120.0, cpu_s=60, memory_bytes=256 << 20))
    assert result.stopped == "memory" and "memory limit" in result.as_observation(), result
    assert len(made) == 1 and not made[0].exists()


@pytest.mark.skipif(not _has("pids"), reason="needs cgroup v2's pids controller delegated")
async def test_the_runs_pids_max_bounds_its_tasks_where_rlimit_nproc_does_not(delegated):
    # host root (uid 0): RLIMIT_NPROC does not bind it, the group alone does (as the v1 test)
    sandbox = BubblewrapSandbox(BubblewrapOptions(cgroups="v2", max_processes=8, uid=0, gid=0))
    made = _recording(sandbox)
    result = await sandbox.run(THREADS, SandboxLimits(timeout_s=60.0))
    assert result.stdout.split() == ["threads", "7"] and result.exit_code == 0, result  # 8 tasks with its own
    assert len(made) == 1 and not made[0].exists()


async def test_a_gvisor_runs_sentry_and_gofer_end_with_its_group(delegated):
    # a gVisor run's host processes (runsc, its Sentry and gofer) join the run's v2 group; the parent exits while its
    # children hold memory, so the Sentry may outlive runsc: the group's end kills what is left and removes it
    sandbox = build_sandbox(SandboxSettings(backend="gvisor", cgroups="v2"))
    assert isinstance(sandbox, GvisorSandbox)
    await sandbox.check()  # fails the test where runsc cannot start a sandbox: `make test` installs it
    assert "cgroup v2 group per run (hugetlb" in sandbox.description  # logged at start and in the health answer
    made = _recording(sandbox)
    try:
        for _ in range(3):
            result = await sandbox.run(textwrap.dedent("""
                import os, time
                for _ in range(4):
                    if os.fork() == 0:
                        block = bytearray(40 << 20)
                        for i in range(0, len(block), 4096):
                            block[i] = 1
                        time.sleep(100)
                print('parent exits')
            """), SandboxLimits(timeout_s=60.0, cpu_s=30))
            assert result.stdout.strip() == "parent exits", result
        call = asyncio.ensure_future(sandbox.run("import time; time.sleep(600)", SandboxLimits(timeout_s=300.0)))
        try:
            async with asyncio.timeout(60):
                while not (len(made) == 4 and len(_procs(made[-1])) >= 3):  # the event: runsc, gofer, Sentry in it
                    await asyncio.sleep(0.01)
            tree = _procs(made[-1])
        finally:
            call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        await sandbox.close()
    assert len(made) == 4 and not [path for path in made if path.exists()]  # 3 runs and the cancelled one
    assert not [pid for pid in tree if _running(pid)], tree
