"""The gVisor backend (``sandbox.backend: gvisor``) on real ``runsc``: a kernel per run.

What the bubblewrap backend cannot close on a shared kernel is checked here first: counters global to one kernel
(the pipe and socket inode numbers, dentries) start fresh in every run, so one run moving them carries nothing to the
next. Then the backend's own guarantees, as the bubblewrap tests check them: the host tree absent, no network, the
per-run limits (CPU, memory spread over processes, wall clock, output, tmpfs), and a cancelled run leaving nothing
running; and a tool episode through the real scorer's ``EnvironmentService`` on this backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from fastexp.v1 import environment_pb2, environment_pb2_grpc
from services.scorer.sandbox import GvisorSandbox, SandboxLimits, SandboxSettings, build_sandbox
from services.scorer.sandbox.cgroup import RunGroups
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings

ROOT = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(timeout_s=40.0, cpu_s=2, memory_bytes=256 << 20)
#: For runs whose work goes through the Sentry (page faults, writes): CPU to spare on a loaded host, so that the
#: limit under test, not the CPU one, stops them.
SPARE_CPU = SandboxLimits(timeout_s=120.0, cpu_s=60, memory_bytes=256 << 20)


@pytest.fixture(scope="module")
async def gvisor():
    sandbox = build_sandbox(SandboxSettings(backend="gvisor"))
    assert isinstance(sandbox, GvisorSandbox)
    await sandbox.check()  # fails the module where runsc cannot start a sandbox: `make test` installs it
    yield sandbox
    await sandbox.close()


async def run(sandbox: GvisorSandbox, code: str, limits: SandboxLimits = LIMITS):
    return await sandbox.run(textwrap.dedent(code), limits)


def _runsc_processes(sandbox: GvisorSandbox) -> list[int]:
    """The processes of ``sandbox``'s runs (``runsc run``, its gofer and Sentry name the run's state folder below
    the backend's own), wherever they were re-parented; not another backend's that may run beside the tests."""
    home = str(sandbox._folder()).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            command = line.split(b"\0")
            if (command[0].endswith(b"runsc") or command[0].startswith(b"runsc-")) and home in line:
                found.append(int(entry.name))
    return found


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


async def test_counters_of_the_kernel_start_fresh_in_every_run(gvisor):
    """The pipe/socket inode counter is one per kernel: under bubblewrap a run that makes 500 pipes moves the next
    run's numbers by thousands (bits carried between calls); here every run's first pipe has the same number."""
    probe = """
        import os, socket
        first, _ = os.pipe()
        held = socket.socket()
        print(os.fstat(first).st_ino, os.fstat(held.fileno()).st_ino)
        for _ in range({count}):
            a, b = os.pipe(); os.close(a); os.close(b)
    """
    results = [await run(gvisor, probe.format(count=count)) for count in (0, 500, 20, 0)]
    seen = [result.stdout.split() for result in results]
    assert all(len(numbers) == 2 for numbers in seen), results
    assert seen[1:] == seen[:1] * 3


async def test_the_host_tree_and_network_are_absent(gvisor):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    marker = "fx-" + secrets.token_hex(6)
    try:
        result = await run(gvisor, f"""
            import os, socket
            for path in ['/root', '/home', '/etc/passwd', {str(ROOT)!r}, '/var', '/run']:
                print(path, os.path.exists(path))
            s = socket.socket()
            s.settimeout(5)
            try:
                s.connect(('127.0.0.1', {port})); s.sendall(b{marker!r}); print('connected')
            except OSError as error:
                print('refused', error.errno)
            print(os.getuid(), sorted(os.listdir('/tmp')))
        """)
        listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing of the run reached the host's loopback
    finally:
        listener.close()
    assert result.exit_code == 0, result
    assert "True" not in result.stdout and "connected" not in result.stdout and "refused" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "65534 ['main.py']"


async def test_per_run_limits_hold(gvisor):
    busy = await run(gvisor, "while True: pass")
    assert busy.stopped == "cpu"
    spread = await run(gvisor, """
        import os, time
        for _ in range(4):  # each under RLIMIT_AS, together past the run's memory
            if os.fork() == 0:
                block = bytearray(150 << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(60)
        time.sleep(60)
    """, SPARE_CPU)
    assert spread.stopped == "memory"
    slow = await run(gvisor, "import time; time.sleep(60)", SandboxLimits(timeout_s=2.0))
    assert slow.stopped == "timeout"
    loud = await run(gvisor, "while True: print('x' * 1000)", SandboxLimits(max_output_bytes=4096))
    assert loud.stopped == "output" and len(loud.stdout) < 4200
    full = await run(gvisor, """
        for i in range(200):
            open(f'/tmp/f{i}', 'wb').write(b'a' * (1 << 20))
    """, SPARE_CPU)
    assert "No space left on device" in full.stderr and full.stopped == ""


async def test_a_cancelled_run_leaves_nothing_running(gvisor):
    before = set(_runsc_processes(gvisor))
    call = asyncio.ensure_future(run(gvisor, "import time; time.sleep(600)"))
    deadline = asyncio.get_running_loop().time() + 60
    while not set(_runsc_processes(gvisor)) - before:  # the event: the run's sandbox is up
        assert asyncio.get_running_loop().time() < deadline, "the run's sandbox never started"
        await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert set(_runsc_processes(gvisor)) - before == set()
    home = gvisor._home
    assert home is not None and sorted(p.name for p in home.iterdir()) == ["root", "rootfs", "usr"]  # no run's bundle or state


async def test_a_tool_episode_runs_under_gvisor_through_the_scorer(tmp_path):
    from services.scorer.config import EnvironmentConfig, default_environments

    token = "fx-" + secrets.token_hex(8)
    (tmp_path / "admin-tokens").write_text(token + "\n")
    tool = EnvironmentConfig(name="python_tool", cls="services.scorer.builtin_environments:PythonTool",
                             options={"limits": {"timeout_s": 40.0, "cpu_s": 2}})
    settings = ScorerSettings(
        port=0, environment_workers=1, admin_tokens_file=tmp_path / "admin-tokens",
        environments=[e for e in default_environments() if e.name != "python_tool"] + [tool],
        sandbox=SandboxSettings(backend="gvisor"),
    )
    core = build_scorer(settings)
    running = await start_scorer(settings, core)
    auth = (("authorization", f"Bearer {token}"),)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            start = await stub.StartEpisode(environment_pb2.StartEpisodeRequest(
                environment="python_tool", prompt="p", reference="1", max_turns=4), metadata=auth)
            code = "import os; print(6 * 7, os.uname().release)"
            action = f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": code}})}</tool_call>'
            step = await stub.Step(environment_pb2.StepRequest(session_id=start.session_id, action=action),
                                   metadata=auth)
            await stub.EndEpisode(environment_pb2.EndEpisodeRequest(session_id=start.session_id), metadata=auth)
    finally:
        await running.server.stop(0)
        await core.close()
    answer, release = step.observation.split()
    assert step.observation_role == "tool" and answer == "42"
    assert release != os.uname().release  # the run saw a kernel of its own, not the host's


async def test_the_host_mappings_standing_for_the_runs_count_toward_its_memory(gvisor):
    """Under the ptrace platform each mapping of the tool's is a mapping of a host process (kernel memory no resident
    set shows): :func:`sandbox_usage` counts them, so they weigh on ``memory_bytes`` (MAPPING_BYTES each)."""
    from services.scorer.sandbox.gvisor_usage import sandbox_usage
    from services.scorer.sandbox.usage import MAPPING_BYTES

    before = set(_runsc_processes(gvisor))
    call = asyncio.ensure_future(run(gvisor, """
        import ctypes, time
        libc = ctypes.CDLL(None)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base = libc.mmap(None, 40000 * 4096, 3, 0x22, -1, 0)  # read-write, private, anonymous
        pages = (ctypes.c_char * (40000 * 4096)).from_address(base)
        for page in range(0, 40000, 2):
            libc.mprotect(base + page * 4096, 4096, 1)  # every other page read-only: 40,000 mappings
            pages[(page + 1) * 4096] = b'x'  # the writable ones touched: each a host mapping of its own
        time.sleep(600)
    """, SandboxLimits(timeout_s=300.0, cpu_s=60)))  # each mprotect is a trip through the Sentry: CPU to spare
    loop = asyncio.get_running_loop()
    deadline, seen = loop.time() + 60, 0
    while seen < 20_000:  # the event: the run's host processes hold the tool's mappings
        assert loop.time() < deadline and not call.done(), (seen, call.done() and call.result())
        roots = [pid for pid in set(_runsc_processes(gvisor)) - before if _parent(pid) == os.getpid()]  # `runsc run`
        usage = await asyncio.to_thread(sandbox_usage, roots[0]) if roots else None
        seen = usage[0].mappings if usage else 0
        await asyncio.sleep(0.1)
    assert usage is not None and usage[0].memory_bytes > seen * MAPPING_BYTES  # and they weigh on its memory
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_reading_usr_leaves_no_access_time_and_runs_write_nothing_beside_it(gvisor):
    """The eighth review: a run's reads stamped the host files' access times, which a later run read back (64 bits),
    and each run's bundle, written to the disk /usr lies on, moved the free inodes concurrent runs read through
    statvfs('/usr'). A root scorer's runs see /usr through a bind without access times; the bundles live on a
    tmpfs."""
    path = sorted(glob.glob("/usr/lib/python3*/this.py"))[0]
    before = os.stat(path)
    stale = before.st_mtime_ns - 2 * 86_400 * 10**9  # older than its contents: relatime stamps the next read
    try:
        os.utime(path, ns=(stale, before.st_mtime_ns))
        with open(path, "rb") as file:  # the control: the host's own read is stamped on this filesystem
            file.read()
        assert os.stat(path).st_atime_ns != stale, "this host does not stamp access times: nothing to test"
        os.utime(path, ns=(stale, before.st_mtime_ns))
        result = await run(gvisor, f"print(len(open({path!r}, 'rb').read()))")
        assert result.stdout.strip() == str(before.st_size), result
        assert os.stat(path).st_atime_ns == stale
    finally:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert gvisor._home is not None and os.stat(gvisor._home).st_dev != os.stat("/usr").st_dev


async def test_code_that_is_not_valid_text_fails_as_code(gvisor):
    """A lone surrogate in the code (the review's A11) raised in the scorer after runsc had started; it is now
    invalid UTF-8 that Python reports, and nothing of the run is left."""
    before = set(_runsc_processes(gvisor))
    result = await run(gvisor, "print('\ud800')")
    assert result.exit_code != 0 and "SyntaxError" in result.stderr, result
    assert set(_runsc_processes(gvisor)) - before == set()


BURST = """
    import mmap, os, time
    for _ in range(12):  # each under its own RLIMIT_AS, at once; 12 x 200 MB against memory_bytes 256 MiB
        if os.fork() == 0:
            block = mmap.mmap(-1, 200 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
            time.sleep(600)
    time.sleep(600)
"""


async def test_a_burst_between_two_samples_meets_the_runs_memory_group(gvisor):
    """The eighth review's burst: processes pre-faulting their memory at once reached 6.8 GB between two samples of
    a 512 MiB run. A root scorer on a host with cgroup v1's memory controller puts each run in a memory group of its
    own (``memory_bytes`` + :data:`GROUP_HEADROOM_BYTES`): the kernel refuses the memory past it, and the run ends
    reported as over its memory."""
    from services.scorer.sandbox.cgroup import RunGroups
    from services.scorer.sandbox.gvisor import GROUP_HEADROOM_BYTES

    groups = RunGroups.find()
    assert groups is not None, "this host's memory controller is where the test expects it (cgroup v1, writable)"
    peaks: list[int] = []
    mine: set[Path] = set()

    async def watch_the_group() -> None:  # the group of the runsc this process started, read while it exists
        while True:
            for pid in _runsc_processes(gvisor):
                if _parent(pid) == os.getpid():
                    with contextlib.suppress(OSError, ValueError, StopIteration):
                        command = Path(f"/proc/{pid}/cmdline").read_bytes()
                        line = next(x for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if ":memory:" in x)
                        # a process that exited in between is a zombie, listed in the root group with no command
                        # line (CI's fresh clone saw "memory:/"): what was read counts only if it still runs
                        if not command or Path(f"/proc/{pid}/cmdline").read_bytes() != command:
                            continue
                        group = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
                        peaks.append(int((group / "memory.max_usage_in_bytes").read_text()))
                        mine.add(group)
            await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch_the_group())
    try:
        result = await run(gvisor, BURST, SandboxLimits(timeout_s=120.0, cpu_s=60, memory_bytes=256 << 20))
    finally:
        watcher.cancel()
    assert result.stopped == "memory", result
    assert len(mine) == 1 and next(iter(mine)).name.startswith("fastexp-run-") and next(iter(mine)).parent == groups.parent
    assert max(peaks) <= (256 << 20) + GROUP_HEADROOM_BYTES + (1 << 20)  # (the kernel charges pages in batches)
    assert not next(iter(mine)).exists()  # each run's group is removed with it


async def test_the_root_is_a_filesystem_of_the_runs_own(gvisor):
    """The ninth review: gVisor answers statfs('/') with the host filesystem the root lies on, and on /dev/shm, where
    runs' bundles are written, its free inodes told how many runs were going. A root scorer's runs get a root on a
    1 MiB tmpfs of their own (64 inodes), which nothing else writes."""
    result = await run(gvisor, """
        import os
        s = os.statvfs('/')
        print(s.f_blocks * s.f_frsize, s.f_files)
    """)
    size, inodes = (int(x) for x in result.stdout.split())
    assert size <= 1 << 20 and inodes <= 64, result


async def test_each_runs_memory_group_is_removed_even_when_its_processes_outlive_runsc(gvisor):
    """The ninth review: runsc is reaped before the Sentry, gofer and the processes standing for the tool's, which
    may still be exiting in the run's group; removing it then failed (EBUSY) and the group stayed (5 of 12 runs whose
    parent exits while children hold memory). What is left is killed and the group removed (its cpuacct group too,
    where the host has one)."""
    made: list[list[Path]] = []

    class Recorded(RunGroups):
        def create(self, limit_bytes: int):
            group = super().create(limit_bytes)
            assert group.pids_path is None  # a gVisor run's host tasks are its kernel's: no pids group (gvisor.py)
            made.append([p for p in (group.path, group.cpu_path) if p is not None])
            return group

    assert gvisor._groups is not None
    gvisor._groups, groups = Recorded(gvisor._groups.parent, gvisor._groups.cpu_parent), gvisor._groups
    try:
        for _ in range(8):
            result = await run(gvisor, """
                import os, time
                for _ in range(6):
                    if os.fork() == 0:
                        block = bytearray(60 << 20)
                        for i in range(0, len(block), 4096):
                            block[i] = 1
                        time.sleep(100)
                print('parent exits')
            """, SPARE_CPU)
            assert result.stdout.strip() == "parent exits", result
    finally:
        gvisor._groups = groups
    assert len(made) == 8 and not [path for paths in made for path in paths if path.exists()]
    assert gvisor._groups.cpu_parent is None or all(len(paths) == 2 for paths in made)


async def test_a_runs_memory_group_is_emptied_before_it_is_removed(gvisor):
    """The tenth review: a group removed while pages of the page cache were still charged to it (a /usr file its run
    read first) stayed alive in the kernel, out of sight, one of the host's 65,535 memory-group ids a call. The
    scorer empties each group (``memory.force_empty``) before removing it: what 4 runs each brought into the page
    cache (files evicted first) is out of it again after them, so nothing was left charged to their groups; and a
    later run cannot time those files (the eighth review read 29 of 32 bits so between calls)."""
    files = sorted(glob.glob("/usr/lib/python3*/*.py"))[:4]
    for path in files:
        with open(path, "rb") as file:  # out of the page cache: the run's read brings it in, charged to its group
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert _cached_pages(path) == 0
        result = await run(gvisor, f"print(len(open({path!r}, 'rb').read()))")
        assert result.stdout.strip() == str(os.path.getsize(path)), result
        assert _cached_pages(path) == 0, path
    with open(files[0], "rb") as file:  # the control: a read of the host's own does cache it
        file.read()
    assert _cached_pages(files[0]) > 0


def _cached_pages(path: str) -> int:
    """Pages of ``path`` in the host's page cache (util-linux ``fincore``)."""
    out = subprocess.run(["fincore", "--noheadings", "--output", "PAGES", path], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    return int(out.split()[0])


_SCORER_TO_KILL = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from services.scorer.sandbox import GvisorSandbox, SandboxLimits

async def main():
    sandbox = GvisorSandbox()
    print(sandbox._folder(), flush=True)
    await sandbox.run("while True: pass", SandboxLimits(timeout_s=3600, cpu_s=3600))

asyncio.run(main())
"""


def _processes_under(home: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if home.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


async def test_a_run_dies_with_its_scorer():
    """The review of this change: the run's limits are the scorer's to keep, so a scorer killed outright (SIGKILL,
    the OOM killer) must take its runs with it, as a bubblewrap run's --die-with-parent does. A scorer process is
    killed while its run spins; the run's processes go."""
    scorer = await asyncio.create_subprocess_exec(sys.executable, "-c", _SCORER_TO_KILL, str(ROOT),
                                                  stdout=asyncio.subprocess.PIPE)
    assert scorer.stdout is not None
    home = (await scorer.stdout.readline()).decode().strip()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while not [pid for pid in _processes_under(home) if pid != scorer.pid]:  # the event: its run is up
        assert loop.time() < deadline and scorer.returncode is None, "the run never started"
        await asyncio.sleep(0.05)
    scorer.kill()
    await scorer.wait()
    deadline = loop.time() + 30
    while left := _processes_under(home):  # the event: the last of them gone
        assert loop.time() < deadline, f"the run outlived its scorer: {left}"
        await asyncio.sleep(0.05)
