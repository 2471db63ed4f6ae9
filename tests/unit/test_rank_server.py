"""`mtcore train`'s rank server (``mtcore.cli.launch.start_rank_server``) in a process
of its own, as a program that calls `mtcore train`'s ``main`` in-process would see it:
the server ignores SIGTERM while it serves, and ending it leaves the process's fork
server as it was (a later one starts afresh, with the preload it had, and takes
SIGTERM); a process that already ran a fork server keeps it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

CHECK = """
import json, multiprocessing, os, signal
from multiprocessing import forkserver
from mtcore.cli.launch import start_rank_server

def ignores_sigterm(pid):
    status = open(f"/proc/{pid}/status").read()
    mask = int(status.split("SigIgn:")[1].split()[0], 16)
    return bool(mask & (1 << signal.SIGTERM - 1))

def served():  # a process forked by the server: its preload is done by then
    child = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    child.start()
    child.join()
    return forkserver._forkserver._forkserver_pid

facts = {"preload_before": list(forkserver._forkserver._preload_modules)}
stop = start_rank_server()
ours = served()
facts["ours_ignores_sigterm"] = ignores_sigterm(ours)
stop()
facts["ours_alive"] = os.path.exists(f"/proc/{ours}")
facts["forgotten"] = forkserver._forkserver._forkserver_pid is None
facts["preload_after"] = list(forkserver._forkserver._preload_modules)
later = served()
facts["later_is_new"] = later != ours
facts["later_ignores_sigterm"] = ignores_sigterm(later)
keep = start_rank_server()  # one runs already: it is kept, and nothing ends it
keep()
facts["kept"] = forkserver._forkserver._forkserver_pid == later
print(json.dumps(facts))
"""


def test_the_rank_server_ignores_sigterm_and_ending_it_leaves_the_fork_server_as_it_was():
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["ours_ignores_sigterm"]
    assert not facts["ours_alive"] and facts["forgotten"]
    assert facts["preload_after"] == facts["preload_before"]
    assert facts["later_is_new"] and not facts["later_ignores_sigterm"]
    assert facts["kept"]
