"""The tool sandbox against a hostile policy, through the real scorer's ``EnvironmentService`` (``python_tool``, one
Hermes tool call per episode), on real bubblewrap.

Each attack asserts that the act failed *and* that its side effect is absent when checked from outside (files,
processes, connections, the scorer's own state). Then: a benign call works, the scorer refuses ``python_tool`` where
isolation cannot be set up (no ``bwrap``; user namespaces refused), and the remote backend runs through a real
sandbox server with a total deadline and a response cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response

from fastexp.v1 import environment_pb2, environment_pb2_grpc
from services.scorer.sandbox import RemoteSandbox, SandboxError, SandboxLimits, SandboxSettings
from services.scorer.sandbox.bubblewrap import BubblewrapOptions, BubblewrapSandbox
from services.scorer.sandbox.server import SandboxServerSettings, create_app
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings
from tests.support.http_servers import serving

ROOT = Path(__file__).resolve().parents[2]
SECRET = "fx-secret-" + secrets.token_hex(8)
MARKER = "fx-marker-" + secrets.token_hex(6)
TOOL_LIMITS = {"timeout_s": 40.0, "cpu_s": 2}  # wall clock far past CPU: robust on a loaded machine


def _call(code: str) -> str:
    return f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": textwrap.dedent(code)}})}</tool_call>'


async def _scorer(settings: ScorerSettings):
    core = build_scorer(settings)
    running = await start_scorer(settings, core)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    return core, running, channel, environment_pb2_grpc.EnvironmentServiceStub(channel)


async def _stop(core, running, channel) -> None:
    await channel.close()
    await running.server.stop(0)
    await core.close()


def _environments(limits: dict = TOOL_LIMITS):
    from services.scorer.config import EnvironmentConfig, default_environments

    tool = EnvironmentConfig(name="python_tool", cls="services.scorer.builtin_environments:PythonTool",
                             options={"limits": limits})
    return [e for e in default_environments() if e.name != "python_tool"] + [tool]


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Path:
    """A folder on the host with a token file and a victim file the tool must not touch."""
    folder = tmp_path_factory.mktemp("host")
    (folder / "admin-tokens").write_text(SECRET + "\n")
    (folder / "victim.txt").write_text("original")
    return folder


@pytest.fixture(scope="module")
async def scorer(host):
    os.environ["FASTEXP_TEST_SECRET"] = SECRET  # in the scorer's process environment (in-process server)
    settings = ScorerSettings(port=0, environment_workers=1, admin_tokens_file=host / "admin-tokens",
                              environments=_environments())
    core, running, channel, stub = await _scorer(settings)
    yield stub
    await _stop(core, running, channel)
    os.environ.pop("FASTEXP_TEST_SECRET", None)


AUTH = (("authorization", f"Bearer {SECRET}"),)


async def tool(stub, code: str) -> str:
    """One episode of ``python_tool`` whose one turn is ``code``; returns the tool's output as the policy sees it."""
    start = await stub.StartEpisode(environment_pb2.StartEpisodeRequest(
        environment="python_tool", prompt="p", reference="1", max_turns=4), metadata=AUTH)
    step = await stub.Step(environment_pb2.StepRequest(session_id=start.session_id, action=_call(code)),
                           metadata=AUTH)
    await stub.EndEpisode(environment_pb2.EndEpisodeRequest(session_id=start.session_id), metadata=AUTH)
    assert step.observation_role == "tool"
    return step.observation


def _host_processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


# --- a benign call --------------------------------------------------------------------------------------------

async def test_a_benign_call_runs_and_can_use_its_work_folder(scorer):
    out = await tool(scorer, """
        import math, subprocess, sys
        open('notes.txt', 'w').write(str(math.factorial(5)))
        print(open('notes.txt').read(), subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True,
              text=True).stdout.strip())
    """)
    assert out.strip() == "120 7"


# --- files and secrets ----------------------------------------------------------------------------------------

async def test_the_admin_token_file_cannot_be_read_by_its_path(scorer, host):
    out = await tool(scorer, f"print(open({str(host / 'admin-tokens')!r}).read())")
    assert SECRET not in out and "No such file" in out


async def test_the_host_tree_is_absent(scorer):
    out = await tool(scorer, f"""
        import os
        for path in ['/root', '/home', '/etc/shadow', '/etc/passwd', {str(ROOT)!r}, '/var', '/run']:
            print(path, os.path.exists(path))
        print(sorted(os.listdir('/')))
    """)
    assert "True" not in out.replace("'", "")
    assert out.strip().splitlines()[-1] == "['bin', 'dev', 'lib', 'lib64', 'proc', 'sbin', 'tmp', 'usr']"


async def test_the_scorers_environment_cannot_be_read_from_proc(scorer):
    out = await tool(scorer, f"""
        import os
        found = []
        for pid in [p for p in os.listdir('/proc') if p.isdigit()] + [{os.getpid()!r}]:
            try:
                found.append(open(f'/proc/{{pid}}/environ', 'rb').read())
            except OSError as error:
                print(pid, type(error).__name__)
        print(b'FASTEXP' in b''.join(found), sorted(p for p in os.listdir('/proc') if p.isdigit()))
        print(dict(os.environ))
    """)
    assert SECRET not in out and "FASTEXP_TEST_SECRET" not in out
    visible = out.strip().splitlines()[-2]
    assert visible.startswith("False") and str(os.getpid()) not in visible.split(" ", 1)[1]


async def test_a_write_through_a_directory_fd_stays_inside(scorer, host):
    out = await tool(scorer, f"""
        import os
        try:
            fd = os.open({str(host)!r}, os.O_RDONLY)
            os.close(os.open('escape.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd))
            print('written')
        except OSError as error:
            print('refused', error)
    """)
    assert "refused" in out and not (host / "escape.txt").exists()


async def test_a_rename_cannot_replace_a_file_outside(scorer, host):
    out = await tool(scorer, f"""
        import os
        open('mine', 'w').write('replaced')
        try:
            os.rename('mine', {str(host / 'victim.txt')!r})
            print('renamed')
        except OSError as error:
            print('refused', error)
    """)
    assert "refused" in out and (host / "victim.txt").read_text() == "original"


async def test_read_only_root_and_no_device_files(scorer):
    out = await tool(scorer, """
        import os
        for path in ['/usr/lib/fx', '/bin/fx', '/fx', '/dev/sda', '/dev/shm/fx', '/proc/fx']:
            try:
                open(path, 'w').write('x'); print('wrote', path)
            except OSError as error:
                print('refused', path, error.errno)
        print(sorted(os.listdir('/dev')))
    """)
    assert "wrote" not in out and "sda" not in out.splitlines()[-1]


# --- processes, signals, the Python layer ------------------------------------------------------------------------

async def test_a_shell_started_any_way_cannot_reach_the_host(scorer, host):
    out = await tool(scorer, f"""
        import os, subprocess
        target, tokens = {str(host / 'pwned')!r}, {str(host / 'admin-tokens')!r}
        r = subprocess.run(['/bin/sh', '-c', 'echo pwned > ' + target + '; cat ' + tokens], capture_output=True,
                           text=True)
        print('sh', r.returncode, r.stdout)
        os.system('echo pwned > ' + target)
        print('done')
    """)
    assert "sh 1" in out or "sh 2" in out
    assert SECRET not in out and not (host / "pwned").exists()


async def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing(scorer):
    out = await tool(scorer, f"""
        import os, sys
        n = 0
        try:
            for _ in range(200):
                if os.fork() == 0:
                    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', {MARKER + '-bomb'!r}])
                n += 1
        except OSError as error:
            print('stopped after', n, error.errno)
    """)
    assert "stopped after" in out and int(out.split("stopped after")[1].split()[0]) < 20
    await asyncio.sleep(0.5)
    assert _host_processes_with(MARKER + "-bomb") == []


async def test_a_daemon_does_not_outlive_its_run(scorer):
    out = await tool(scorer, f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', {MARKER!r}], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print('spawned')
    """)
    assert "spawned" in out
    assert _host_processes_with(MARKER) == []  # the run's whole tree is reaped before the call returns


async def test_signals_cannot_reach_the_scorer(scorer):
    """Signal 0 (no effect, only the permission and existence check): a failure here must not harm the machine."""
    out = await tool(scorer, f"""
        import os
        for pid in ({os.getpid()}, {os.getppid()}, -1):
            try:
                os.kill(pid, 0); print('reachable', pid)
            except OSError as error:
                print('refused', pid, error.errno)
    """)
    assert out.split() == ["refused", str(os.getpid()), "3", "refused", str(os.getppid()), "3", "refused", "-1", "3"]
    assert (await tool(scorer, "print('alive')")).strip() == "alive"  # the scorer (this process) still serves


async def test_no_namespace_mount_or_capability_from_ctypes(scorer):
    out = await tool(scorer, """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print('unshare', libc.unshare(0x10000000), ctypes.get_errno())   # CLONE_NEWUSER
        print('mount', libc.mount(b'none', b'/usr', b'tmpfs', 0, None), ctypes.get_errno())
        print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])
    """)
    lines = out.strip().splitlines()
    assert lines[0].startswith("unshare -1") and lines[1].startswith("mount -1") and lines[2] == "0" * 16


async def test_files_vanish_with_the_run(scorer):
    out = await tool(scorer, f"""
        open('/tmp/{MARKER}', 'w').write('x')
        print('written')
    """)
    assert "written" in out and not Path(f"/tmp/{MARKER}").exists() and not Path(f"/dev/shm/{MARKER}").exists()
    again = await tool(scorer, f"import os; print(os.path.exists('/tmp/{MARKER}'))")
    assert again.strip() == "False"


_IPC_KEY = 0x5EED


async def test_nothing_a_call_leaves_reaches_the_next_call_or_the_host(scorer):
    """A first episode leaves what it can: files (/tmp, its work folder; /dev/shm is read-only), a POSIX message
    queue, a listening abstract unix socket (System V shared memory, message queues and semaphores are refused:
    they would hold memory no limit sees). A second episode (another tenant's, to the scorer) finds none of them,
    and the host holds none (its /tmp, its System V IPC tables, its unix sockets)."""
    left = await tool(scorer, f"""
        import ctypes, os, socket
        libc, rt = ctypes.CDLL(None, use_errno=True), ctypes.CDLL('librt.so.1', use_errno=True)
        for path in ('/tmp/{MARKER}', '/dev/shm/{MARKER}', '{MARKER}'):
            try:
                open(path, 'w').write('x'); print('file', path)
            except OSError:
                pass
        print('shm', libc.shmget({_IPC_KEY}, 4096, 0o1666), 'msg', libc.msgget({_IPC_KEY}, 0o1666),
              'sem', libc.semget({_IPC_KEY}, 1, 0o1666), 'mq', rt.mq_open(b'/{MARKER}', os.O_CREAT | os.O_RDWR, 0o666, None))
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); server.bind('\\0{MARKER}'); server.listen()
        print('listening')
    """)
    assert "file /tmp/" in left and "listening" in left and "shm -1 msg -1 sem -1" in left, left
    assert "mq -1" not in left, left
    found = await tool(scorer, f"""
        import ctypes, os, socket
        libc, rt = ctypes.CDLL(None, use_errno=True), ctypes.CDLL('librt.so.1', use_errno=True)
        found = [p for p in ('/tmp/{MARKER}', '/dev/shm/{MARKER}', '{MARKER}') if os.path.exists(p)]
        found += [name for name, id in (('shm', libc.shmget({_IPC_KEY}, 0, 0)), ('msg', libc.msgget({_IPC_KEY}, 0)),
                                        ('sem', libc.semget({_IPC_KEY}, 0, 0)),
                                        ('mq', rt.mq_open(b'/{MARKER}', os.O_RDWR, 0, None))) if id >= 0]
        try:
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect('\\0{MARKER}'); found.append('socket')
        except OSError:
            pass
        print(found)
    """)
    assert found.strip() == "[]", found
    assert not Path(f"/tmp/{MARKER}").exists() and not Path(f"/dev/shm/{MARKER}").exists()
    host_ipc = "".join(Path(f"/proc/sysvipc/{table}").read_text() for table in ("shm", "msg", "sem"))
    assert f" {_IPC_KEY} " not in host_ipc and MARKER not in Path("/proc/net/unix").read_text()


# --- network ------------------------------------------------------------------------------------------------------

async def test_no_connection_reaches_a_host_server(scorer):
    accepted = []
    server = await asyncio.start_server(lambda r, w: (accepted.append(1), w.close()), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        out = await tool(scorer, f"""
            import socket
            for host in ('127.0.0.1', 'localhost', '10.0.0.1'):
                try:
                    socket.create_connection((host, {port}), timeout=2); print('connected', host)
                except OSError as error:
                    print('refused', host, type(error).__name__)
        """)
    finally:
        server.close()
    assert "connected" not in out and accepted == []


# --- resources ----------------------------------------------------------------------------------------------------

async def test_memory_cpu_and_disk_are_bounded(scorer):
    memory = await tool(scorer, "x = bytearray(4 * 1024**3)\nprint('allocated')")
    assert "MemoryError" in memory and "allocated" not in memory
    cpu = await tool(scorer, "while True:\n    pass")
    assert "CPU time limit" in cpu
    disk = await tool(scorer, """
        written = 0
        try:
            for i in range(200):
                open(f'f{i}', 'wb').write(b'x' * 1024 * 1024); written += 1
        except OSError as error:
            print('stopped', written, error.errno)
    """)
    assert "stopped" in disk and int(disk.split()[1]) < 80  # the 64 MiB tmpfs


#: A run that spreads its work over three processes, each within its own rlimits (CPU seconds, address space),
#: then waits for them: per process it passes every limit, as a whole it does not.
_SPREAD = """
    import multiprocessing, sys, time
    def work(kind):
        if kind == 'cpu':
            end = time.process_time() + 1.5  # each under the 2 s per-process limit, 4.5 s together
            while time.process_time() < end:
                pass
        elif kind == 'memory':
            held = bytearray(300 * 1024**2)  # each under the 512 MiB address space, 900 MiB together
            held[::4096] = b'x' * len(held[::4096])
            time.sleep(3)
        else:  # shared memory written, then dropped from the resident set: still allocated, resident nowhere
            import mmap
            held, step = mmap.mmap(-1, 300 * 1024**2), 32 * 1024**2
            for start in range(0, len(held), step):
                held[start:start + step] = b'x' * step
                held.madvise(mmap.MADV_DONTNEED, start, step)
            time.sleep(3)
    workers = [multiprocessing.Process(target=work, args=(sys.argv[1] if len(sys.argv) > 1 else KIND,))
               for _ in range(3)]
    for w in workers: w.start()
    for w in workers: w.join()
    print('all done', [w.exitcode for w in workers])
"""


@pytest.mark.parametrize(("kind", "stopped", "observed"), [("cpu", "cpu", "CPU time limit"),
                                                          ("memory", "memory", "memory limit"),
                                                          ("shared", "memory", "memory limit")])
async def test_cpu_and_memory_are_limited_per_run_not_per_process(kind, stopped, observed):
    """cpu_s 2 and memory_bytes 512 MiB hold for the run's whole tree: three processes, each within both, are
    stopped together once their sum passes either (they ran to the end under per-process limits alone)."""
    code = textwrap.dedent(_SPREAD).replace("KIND", repr(kind))
    result = await BubblewrapSandbox().run(code, SandboxLimits(timeout_s=60.0, cpu_s=2, memory_bytes=512 * 1024**2))
    assert result.stopped == stopped and "all done" not in result.stdout, result
    assert observed in result.as_observation()


_MAPPINGS = """
    import ctypes, multiprocessing, time
    def many_mappings():  # 64,000 mappings over untouched pages: ~10 MiB resident, ~15 MiB of kernel slab
        libc = ctypes.CDLL(None)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                 ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base = libc.mmap(None, 64000 * 4096, 1, 0x22, -1, 0)  # PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS
        for page in range(0, 64000, 2):
            libc.mprotect(base + page * 4096, 4096, 0)  # every other page another protection: no merging
        time.sleep(3600)  # held until the run is stopped: the limit, not a timer, ends it
    workers = [multiprocessing.Process(target=many_mappings) for _ in range(14)]
    for w in workers: w.start()
    held = bytearray(300 * 1024**2)  # and resident memory well under the limit
    held[::4096] = b'x' * len(held[::4096])
    for w in workers: w.join()
    print('all done', [w.exitcode for w in workers])
"""


async def test_the_kernel_memory_of_many_mappings_counts_against_the_runs_memory():
    """An attack of the third review (2026-11-25): 14 processes with 64,000 mappings each held ~200 MiB of kernel
    slab no resident set shows, next to ~450 MiB resident, against memory_bytes 512 MiB. Each mapping now counts
    (MAPPING_BYTES), so the run is stopped; it ran to the end before."""
    result = await BubblewrapSandbox().run(textwrap.dedent(_MAPPINGS), SandboxLimits(timeout_s=60.0, cpu_s=30))
    # the mappings push it past its memory; on a loaded host, reading ~900,000 of them may take longer than a sample
    # may (MAX_SAMPLE_S), which stops the run as well (fail closed): either way before it ran to its timeout
    assert result.stopped in ("memory", "usage") and "all done" not in result.stdout, result


def test_mappings_are_counted_from_a_real_process():
    import subprocess
    import sys

    from services.scorer.sandbox.usage import MAPPING_BYTES, TreeUsage, mappings_of

    # the attack's one process, holding its mappings until told to end
    code = textwrap.dedent(_MAPPINGS).split("workers =")[0].replace(
        "time.sleep(3600)", "print('mapped', flush=True); __import__('sys').stdin.read()") + "many_mappings()\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        while child.stdout.readline().strip() != "mapped":
            assert child.poll() is None
        mappings = mappings_of([Path(f"/proc/{child.pid}")])
        assert mappings.count >= 64000
        assert TreeUsage(mappings=mappings.count).memory_bytes == mappings.count * MAPPING_BYTES
    finally:
        child.kill()
        child.wait()


async def test_empty_files_past_the_runs_file_limit_stop_it():
    """Empty files take no tmpfs bytes but ~1 KiB of kernel memory each: past max_files the run is stopped."""
    code = "import os\nfor i in range(1_000_000):\n    open(f'f{i}', 'w').close()\nprint('all created')"
    sandbox = BubblewrapSandbox(BubblewrapOptions(max_files=2000))
    result = await sandbox.run(code, SandboxLimits(timeout_s=60.0, cpu_s=30))
    assert result.stopped == "files" and "all created" not in result.stdout, result
    assert "file count limit" in result.as_observation()


async def test_the_namespaces_init_is_the_tool_so_proc_1_mem_reaches_nothing_but_itself():
    """Without bwrap's own init in the sandbox, /proc/1 is the tool's process (under the filter and the limits):
    writing its memory changes only itself, and it cannot clear the signal that ends it with bwrap's monitor."""
    code = textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(os.getpid(), open('/proc/1/cmdline').read().split('\\0')[-2])
        print(libc.prctl(1, 0, 0, 0, 0), ctypes.get_errno())  # PR_SET_PDEATHSIG 0: clear it
    """)
    result = await BubblewrapSandbox().run(code, SandboxLimits(timeout_s=30.0))
    assert result.stdout.split() == ["1", "main.py", "-1", "1"], result


def test_a_trees_use_sums_its_live_processes_and_their_reaped_children():
    from services.scorer.sandbox.usage import parse_stat, tree_usage_of

    def stat(pid: int, ppid: int, utime: int, cutime: int, rss: int) -> str:
        fields = ["S", str(ppid), *["0"] * 9, str(utime), "0", str(cutime), "0", *["0"] * 6, str(rss), *["0"] * 20]
        return f"{pid} (a (tricky) name) " + " ".join(fields)

    stats = [parse_stat(stat(10, 1, 100, 0, 5)), parse_stat(stat(11, 10, 50, 200, 7)),
             parse_stat(stat(12, 11, 25, 0, 3)), parse_stat(stat(20, 1, 999, 999, 999))]
    usage = tree_usage_of(stats, 10)
    ticks = os.sysconf("SC_CLK_TCK")
    assert usage.processes == 3 and usage.cpu_s == pytest.approx(375 / ticks)
    assert usage.rss_bytes == 15 * os.sysconf("SC_PAGE_SIZE")
    assert tree_usage_of(stats, 99).processes == 0
    with pytest.raises(ValueError):
        parse_stat("not a stat line")


# --- fail closed ------------------------------------------------------------------------------------------------

async def test_without_bwrap_python_tool_is_not_offered_and_nothing_runs():
    settings = ScorerSettings(port=0, environment_workers=1, sandbox=SandboxSettings(bwrap="/nonexistent/bwrap"))
    core, running, channel, stub = await _scorer(settings)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.StartEpisode(environment_pb2.StartEpisodeRequest(
                environment="python_tool", prompt="p", reference="1", max_turns=2))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not offered" in refused.value.details() and "apt-get install bubblewrap" in refused.value.details()
        started = await stub.StartEpisode(environment_pb2.StartEpisodeRequest(
            environment="math_feedback", prompt="p", reference="1", max_turns=2))
        assert started.session_id
    finally:
        await _stop(core, running, channel)


def test_where_user_namespaces_are_refused_the_sandbox_says_so():
    """The probe run where the kernel refuses new user namespaces (as under Docker's default seccomp profile):
    inside an outer bubblewrap whose user namespace forbids nested ones, as an ordinary uid."""
    probe = ("import asyncio\nfrom services.scorer.sandbox import BubblewrapSandbox, SandboxUnavailable\n"
             "try:\n    asyncio.run(BubblewrapSandbox().check())\n    print('ISOLATED')\n"
             "except SandboxUnavailable as error:\n    print('UNAVAILABLE', error)\n")
    result = subprocess.run(
        ["bwrap", "--unshare-user", "--disable-userns", "--uid", "1000", "--gid", "1000", "--dev-bind", "/", "/",
         "--chdir", str(ROOT), sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=120,
    )
    assert "UNAVAILABLE" in result.stdout, result.stdout + result.stderr
    assert "user namespaces" in result.stdout and "ISOLATED" not in result.stdout


async def test_a_bwrap_named_on_the_scorers_path_only_is_the_one_runs_use(tmp_path, monkeypatch):
    # sandbox.bwrap as a bare name found on the scorer's PATH (not in /bin or /usr/bin, where a run's empty
    # environment looks): the start-up check and every run use the same program
    import shutil

    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "fastexp-test-bwrap").symlink_to(shutil.which("bwrap"))
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    from services.scorer.sandbox.bubblewrap import BubblewrapOptions

    sandbox = BubblewrapSandbox(BubblewrapOptions(bwrap="fastexp-test-bwrap"))
    await sandbox.check()
    result = await sandbox.run("print(6 * 7)", SandboxLimits(timeout_s=30.0))
    assert result.stdout.strip() == "42", result


# --- the remote backend -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
async def sandbox_server():
    sandbox = BubblewrapSandbox()
    await sandbox.check()
    with serving(create_app(sandbox, SandboxServerSettings(cpu_s=2))) as url:
        yield url


async def test_python_tool_runs_on_a_remote_sandbox_server(sandbox_server, host):
    settings = ScorerSettings(port=0, environment_workers=1, environments=_environments({"timeout_s": 3.0}),
                              sandbox=SandboxSettings(backend="remote", remote_url=sandbox_server))
    core, running, channel, stub = await _scorer(settings)
    try:
        out = await tool(stub, "import os\nprint(6 * 7, os.getuid(), os.path.exists('/root'))")
        assert out.strip() == "42 65534 False"
        out = await tool(stub, f"print(open({str(host / 'admin-tokens')!r}).read())")
        assert SECRET not in out and "No such file" in out
        assert "wall-clock" in await tool(stub, "import time\ntime.sleep(60)")
    finally:
        await _stop(core, running, channel)


async def _until(condition, timeout_s: float) -> None:
    """Wait until ``condition()`` holds, checking every 50 ms (polling a state, not a delay)."""

    async def check() -> None:
        while not condition():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(check(), timeout_s)


async def test_a_caller_that_hangs_up_ends_its_remote_run_at_once(sandbox_server):
    """The run's caller (the scorer's RemoteSandbox, here a plain HTTP client) gives up while the run sleeps toward
    its 30 s timeout: the server ends the run's whole tree within seconds, not at its timeout."""
    marker = "fx-hangup-" + secrets.token_hex(6)
    code = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', "
            f"{marker!r}])\ntime.sleep(30)")
    async with httpx.AsyncClient() as client:
        post = asyncio.ensure_future(client.post(f"{sandbox_server}/run_code", timeout=60,
                                                 json={"code": code, "run_timeout": 30}))
        await _until(lambda: _host_processes_with(marker), 30)  # the run is under way
        post.cancel()  # the caller hangs up
        with contextlib.suppress(asyncio.CancelledError):
            await post
    await _until(lambda: not _host_processes_with(marker), 10)


async def test_an_unreachable_remote_sandbox_withdraws_python_tool(unused_tcp_port):
    settings = ScorerSettings(port=0, environment_workers=1, sandbox=SandboxSettings(
        backend="remote", remote_url=f"http://127.0.0.1:{unused_tcp_port}"))
    core, running, channel, stub = await _scorer(settings)
    try:
        with pytest.raises(grpc.aio.AioRpcError, match="start the sandbox service"):
            await stub.StartEpisode(environment_pb2.StartEpisodeRequest(
                environment="python_tool", prompt="p", reference="1", max_turns=2))
    finally:
        await _stop(core, running, channel)


def _misbehaving_app() -> FastAPI:
    app = FastAPI()

    @app.post("/slow/run_code")
    async def slow() -> dict:
        await asyncio.sleep(3600)
        return {}

    @app.post("/huge/run_code")
    async def huge() -> Response:
        return Response(b"x" * (8 * 1024 * 1024), media_type="application/json")

    return app


async def test_a_remote_call_has_one_total_deadline_and_a_response_cap():
    with serving(_misbehaving_app()) as url:
        slow = RemoteSandbox(f"{url}/slow", margin_s=0.5)
        started = asyncio.get_running_loop().time()
        with pytest.raises(SandboxError, match="no answer within"):
            await slow.run("print(1)", SandboxLimits(timeout_s=1.0))
        assert asyncio.get_running_loop().time() - started < 5.0
        huge = RemoteSandbox(f"{url}/huge")
        with pytest.raises(SandboxError, match="over the response cap"):
            await huge.run("print(1)", SandboxLimits(timeout_s=5.0))
        await slow.close()
        await huge.close()


async def test_ending_an_episode_ends_its_running_step_and_its_run(scorer):
    # EndEpisode while the episode's step runs tool code: the step's run is killed and reaped before EndEpisode
    # answers, and the Step call fails naming why
    marker = f"3600.{secrets.randbelow(10**6):06d}5"
    start = await scorer.StartEpisode(environment_pb2.StartEpisodeRequest(
        environment="python_tool", prompt="p", reference="1", max_turns=4), metadata=AUTH)
    step = asyncio.ensure_future(scorer.Step(environment_pb2.StepRequest(
        session_id=start.session_id, action=_call(f"import os\nos.execvp('sleep', ['sleep', {marker!r}])")),
        metadata=AUTH))
    await _until(lambda: _host_processes_with(marker), 30)  # the run is under way
    await scorer.EndEpisode(environment_pb2.EndEpisodeRequest(session_id=start.session_id), metadata=AUTH)
    assert _host_processes_with(marker) == []
    with pytest.raises(grpc.aio.AioRpcError, match="the episode ended while its step ran"):
        await step


async def test_cancelled_calls_leave_nothing_running_even_queued_under_load():
    # six calls on two slots, each exec'ing a sleep of its own; cancelled once two of them run (and four wait):
    # when the cancellations complete, no process of any run is left, and the slots are free again
    from services.scorer.sandbox.bubblewrap import BubblewrapOptions

    sandbox = BubblewrapSandbox(BubblewrapOptions(max_concurrent=2))
    markers = [f"3600.{secrets.randbelow(10**6):06d}{i}" for i in range(6)]
    calls = [asyncio.create_task(sandbox.run(f"import os\nos.execvp('sleep', ['sleep', {m!r}])",
                                             SandboxLimits(timeout_s=600.0))) for m in markers]
    async with asyncio.timeout(60):
        while sum(bool(_host_processes_with(m)) for m in markers) < 2:  # the event: two runs' sleeps exist
            await asyncio.sleep(0.05)
    for call in calls:
        call.cancel()
    for call in calls:
        with pytest.raises(asyncio.CancelledError):
            await call
    assert [m for m in markers if _host_processes_with(m)] == []  # killed and reaped before the cancel completed
    result = await sandbox.run("print('free')", SandboxLimits(timeout_s=30.0))  # the slots were given back
    assert result.stdout.strip() == "free"


async def test_a_call_cancelled_while_its_sandbox_starts_leaves_nothing_running():
    # a run cancelled while bwrap's monitor set its sandbox up had its monitor killed before the init it was forking
    # was found: the init ran on, orphaned, holding the run's pipes, so the cancellation never completed (seen when
    # an episode ended while its queued call was starting). Cancelled after 0..39 turns of the event loop, and after
    # a few ms, each start covers a different point of the set-up; each cancellation completes, leaving nothing
    sandbox = BubblewrapSandbox(BubblewrapOptions(max_concurrent=1))
    for point in [*range(40), 0.002, 0.005, 0.01, 0.02, 0.05]:
        marker = f"3600.{secrets.randbelow(10**6):06d}9"
        call = asyncio.create_task(sandbox.run(f"import os\nos.execvp('sleep', ['sleep', {marker!r}])",
                                               SandboxLimits(timeout_s=600.0)))
        if isinstance(point, int):
            for _ in range(point):  # where the cancel lands, not a wait for anything
                await asyncio.sleep(0)
        else:
            await asyncio.wait({call}, timeout=point)
        call.cancel()
        async with asyncio.timeout(60):  # an orphaned init held the run's pipes, and its end waited for them
            await asyncio.wait({call})
        assert call.cancelled() and _host_processes_with(marker) == [], f"cancelled at {point}: its run is left"
    assert (await sandbox.run("print('free')", SandboxLimits(timeout_s=30.0))).stdout.strip() == "free"


async def test_the_system_call_filter_refuses_the_keyring_and_kernel_interfaces():
    # tool code calls the kernel directly (libc's syscall): every one of these is EPERM inside a run, the keyring
    # included (a key the scorer's session holds, or one a previous call left, is out of reach); forks, threads
    # and subprocesses still work
    code = textwrap.dedent("""
        import ctypes, os, subprocess, threading
        libc = ctypes.CDLL(None, use_errno=True)
        def call(number, *args):
            ctypes.set_errno(0)
            return libc.syscall(number, *args), ctypes.get_errno()
        calls = {"keyctl": (250, 0, -3, 0), "add_key": (248, b"user", b"left-behind", b"secret", 6, -3),
                 "request_key": (249, b"user", b"left-behind", None, 0), "bpf": (321, 0, 0, 0),
                 "perf_event_open": (298, 0, 0, -1, -1, 0), "userfaultfd": (323, 0), "ptrace": (101, 0, 1, 0, 0),
                 "unshare": (272, 0x10000000), "mount": (165, b"none", b"/tmp", b"tmpfs", 0, 0),
                 "clone_newuser": (56, 0x10000000 | 17, 0, 0, 0, 0), "shmget": (29, 0x5EED, 4096, 0o1600),
                 "msgget": (68, 0x5EED, 0o1600), "memfd_create": (319, b"x", 0), "prctl_pdeathsig": (157, 1, 0),
                 "prctl_pdeathsig_high_bits": (157, 0x100000001, 0), "prctl_dumpable": (157, 4, 0),
                 "semget": (64, 0, 1, 0o1600),
                 "io_setup": (206, 128, 0)}
        print(sorted(name for name, args in calls.items() if call(*args) != (-1, 1)))
        families = {"vsock": 40, "packet": 17, "alg": 38, "xdp": 44, "appletalk": 5, "key": 15}
        assert all(call(41, family, 1, 0) == (-1, 97) for family in families.values())  # EAFNOSUPPORT
        assert all(call(41, family, 1, 0)[0] >= 0 for family in (1, 2, 10))  # unix, IPv4, IPv6
        print(open("/proc/1/cmdline").read().split("\\0")[-2])  # the namespace's init is the tool itself
        import socket
        try:
            socket.socketpair()[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        except PermissionError:
            pass  # its buffer stays at the host's default
        else:
            print("buffer grown")
        print(open("/proc/keys").read() or "no keys")  # not even the descriptions of the scorer's keys
        print(subprocess.run(["echo", "forked"], capture_output=True, text=True).stdout.strip())
        threading.Thread(target=print, args=("threaded",)).start()
    """)
    # a key in the scorer's own session keyring (this process's; KEY_SPEC_SESSION_KEYRING -3)
    libc = ctypes.CDLL(None, use_errno=True)
    held = libc.syscall(248, b"user", b"fastexp-scorer-secret", b"secret", 6, -3)  # add_key
    assert held > 0, ctypes.get_errno()
    try:
        result = await BubblewrapSandbox().run(code, SandboxLimits(timeout_s=30.0))
    finally:
        libc.syscall(250, 21, held)  # KEYCTL_INVALIDATE
    assert result.stdout.split("\n")[:5] == ["[]", "main.py", "no keys", "forked", "threaded"], result


async def test_a_call_can_neither_probe_nor_evict_the_shared_files_cached_pages():
    """An attack of the third review (2026-11-25): call A evicted 64 files of the shared /usr from the page cache
    (posix_fadvise DONTNEED) and read those whose bit was 1; call B, later, probed each with preadv2(RWF_NOWAIT)
    and read all 64 bits. Both halves are refused now; plain reads and other advice still work."""
    code = textwrap.dedent("""
        import mmap, os
        fd, buf = os.open(os.__file__, os.O_RDONLY), bytearray(4096)
        def refused(action):
            try:
                action()
            except PermissionError:
                return True
            return False
        print(refused(lambda: os.preadv(fd, [buf], 0, os.RWF_NOWAIT)),
              refused(lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)),
              refused(lambda: mmap.mmap(fd, 0, prot=mmap.PROT_READ).madvise(21)),  # MADV_PAGEOUT
              refused(lambda: mmap.mmap(fd, 0, prot=mmap.PROT_READ).madvise(20)))  # MADV_COLD
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        print(os.preadv(fd, [buf], 0) == 4096, os.preadv(fd, [buf], 0, os.RWF_HIPRI) >= 0)
    """)
    result = await BubblewrapSandbox().run(code, SandboxLimits(timeout_s=30.0))
    assert result.stdout.split("\n")[:2] == ["True True True True", "True True"], result


def test_the_sandbox_containers_seccomp_profile_is_the_code_and_bwrap_builds_its_runs_under_it():
    # deploy/seccomp/fastexp-sandbox.json (Compose's and Kubernetes' profile of the sandbox container) is what the
    # code says, an allow list (a call it does not name is refused), and bubblewrap builds its namespaces under that
    # filter: a process that loads it (as the container runtime would) runs the sandbox's probe and serves the
    # sandbox server, which runs a call; inside, the runs' own filter still refuses the keyring
    from services.scorer.sandbox.seccomp import container_profile

    shipped = json.loads((Path(__file__).resolve().parents[2] / "deploy/seccomp/fastexp-sandbox.json").read_text())
    assert shipped == container_profile()
    program = textwrap.dedent(f"""
        import asyncio, errno, json
        import pyseccomp as seccomp
        profile = json.loads({json.dumps(json.dumps(shipped))})
        assert profile["defaultAction"] == "SCMP_ACT_ERRNO"  # an allow list: what it does not name is EPERM
        rules = seccomp.SyscallFilter(defaction=seccomp.ERRNO(profile["defaultErrnoRet"]))
        def arg(a):
            if a["op"] == "SCMP_CMP_MASKED_EQ":
                return seccomp.Arg(a["index"], seccomp.MASKED_EQ, a["value"], a["valueTwo"])
            return seccomp.Arg(a["index"], {{"SCMP_CMP_GE": seccomp.GE, "SCMP_CMP_EQ": seccomp.EQ}}[a["op"]], a["value"])
        for group in profile["syscalls"]:
            conditions = [arg(a) for a in group.get("args", [])]
            action = seccomp.ALLOW if group["action"] == "SCMP_ACT_ALLOW" else seccomp.ERRNO(group["errnoRet"])
            for name in group["names"]:
                if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) < 0:
                    continue  # a name this architecture lacks, as a runtime skips it; any other error fails
                rules.add_rule(action, name, *conditions)
        rules.load()  # this process and its children: the container
        import ctypes, threading, time, urllib.request
        import uvicorn
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.syscall(239, 0, 0, 0, 0, 0), ctypes.get_errno())  # get_mempolicy: named nowhere, so refused
        print(libc.syscall(135, ctypes.c_ulong(0xFFFFFFFF)) >= 0)  # personality's query (unsigned long): allowed
        from services.scorer.sandbox.base import SandboxLimits
        from services.scorer.sandbox.bubblewrap import BubblewrapSandbox
        from services.scorer.sandbox.server import SandboxServerSettings, server_config
        async def main():
            sandbox = BubblewrapSandbox()
            await sandbox.check()
            code = "import ctypes\\nlibc = ctypes.CDLL(None, use_errno=True)\\nprint(libc.syscall(250, 0, -3, 0), ctypes.get_errno())"
            print((await sandbox.run(code, SandboxLimits(timeout_s=30.0))).stdout.strip())
        asyncio.run(main())
        server = uvicorn.Server(server_config(BubblewrapSandbox(), SandboxServerSettings(port=0, log_level="WARNING")))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:  # uvicorn's own flag
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        call = urllib.request.Request(f"http://127.0.0.1:{{port}}/run_code", data=json.dumps({{"code": "print(6 * 7)"}}).encode(),
                                      headers={{"Content-Type": "application/json"}})
        print(json.loads(urllib.request.urlopen(call, timeout=60).read())["run_result"]["stdout"].strip())
        server.should_exit = True
        print("ISOLATED")
    """)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.split() == ["-1", "1", "True", "-1", "1", "42", "ISOLATED"], result.stdout + result.stderr
