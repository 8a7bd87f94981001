"""The launcher's services die with it: a launcher (a test run, the demo, ``fastexp up``) killed outright must not
leave engines running (``PR_SET_PDEATHSIG`` in each service's process, set by ``setpriv`` before it execs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

LAUNCHER = """
import time
from services.launcher import LocalCluster
cluster = LocalCluster(services=("scorer",), core_split=None)
cluster.start()
print(cluster.processes["scorer"].pid, flush=True)
time.sleep(600)
"""


def test_services_die_with_a_launcher_killed_outright():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        service = int(launcher.stdout.readline())
        os.kill(launcher.pid, signal.SIGKILL)  # no teardown runs
        launcher.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(service, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.killpg(service, signal.SIGKILL)
        raise AssertionError("the scorer outlived its launcher")
    finally:
        if launcher.poll() is None:
            launcher.kill()
