"""Tool programs the sandbox's cgroup tests run, under cgroup v1's groups and v2's alike."""

import textwrap

#: Eight processes pre-faulting 200 MiB each at once, then holding it.
BURST = textwrap.dedent("""
    import mmap, os, time
    for _ in range(8):
        if os.fork() == 0:
            block = mmap.mmap(-1, 200 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
            time.sleep(600)
    time.sleep(600)
""")

#: A parent that ignores SIGCHLD forks 400 workers one after the other, each spending 30 ms of CPU and exiting: the
#: kernel reaps them by itself, so their CPU reaches no process's account in /proc, and a sample 0.1 s apart sees at
#: most one of them alive (12 s of CPU in all).
REAPED_BY_THE_KERNEL = textwrap.dedent("""
    import os, signal, time
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for _ in range(400):
        pid = os.fork()
        if pid == 0:
            end = time.process_time() + 0.03
            while time.process_time() < end:
                pass
            os._exit(0)
        try:
            os.waitpid(pid, 0)  # returns (ECHILD) once the kernel has reaped it
        except ChildProcessError:
            pass
    print("done")
""")

#: Starts threads (small stacks: RLIMIT_AS does not stop them) until one is refused or 40 run, and says how many.
THREADS = textwrap.dedent("""
    import threading
    threading.stack_size(1 << 18)
    started = 0
    try:
        for _ in range(40):
            threading.Thread(target=threading.Event().wait, daemon=True).start()
            started += 1
    except RuntimeError:
        pass
    print("threads", started, flush=True)
""")
