"""The namespace-node harness (``mtcore.testing.nodes``) that the multi-node tests stand on:
real namespaces, real sockets, real processes; skipped with the reason without root."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtcore.testing import nodes

pytestmark = pytest.mark.skipif(nodes.unavailable() is not None, reason=str(nodes.unavailable()))

SERVE = "import socket; s = socket.create_server(('0.0.0.0', 7000)); c, _ = s.accept(); c.sendall(socket.gethostname().encode())"
CONNECT = "import socket, sys; print(socket.create_connection((sys.argv[1], 7000), timeout=3).recv(64).decode())"


def _python(node, code: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return node.run([sys.executable, "-c", code, *args], capture_output=True, text=True, **kwargs)


def test_nodes_have_their_own_names_addresses_and_shared_memory_and_reach_each_other():
    with nodes.NamespaceCluster(3, subnet="198.19.7.0/24") as cluster:
        node0, node1, node2 = cluster.nodes
        assert [n.address for n in cluster.nodes] == ["198.19.7.1", "198.19.7.2", "198.19.7.3"]
        names = _python(
            node2, "import socket; print(socket.gethostname(), socket.gethostbyname('node0'))"
        )
        assert names.stdout.split() == ["node2", "198.19.7.1"], names.stderr
        server = node1.popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while (reply := _python(node0, CONNECT, "node1")).returncode != 0:
            assert time.monotonic() < deadline, reply.stderr
            time.sleep(0.1)
        assert reply.stdout.strip() == "node1"
        server.wait(timeout=10)
        # /dev/shm is the node's own: a file made on node0 is not on node1.
        assert node0.run(["touch", "/dev/shm/made-on-node0"]).returncode == 0
        assert (
            "made-on-node0" in node0.run(["ls", "/dev/shm"], capture_output=True, text=True).stdout
        )
        assert (
            "made-on-node0"
            not in node1.run(["ls", "/dev/shm"], capture_output=True, text=True).stdout
        )
        # Nothing leaves the cluster: no route from a node to any other address, and the
        # host's own namespace has no address in the cluster's subnet.
        out = _python(
            node0, "import socket; socket.create_connection(('203.0.113.7', 80), timeout=2)"
        )
        assert "Network is unreachable" in out.stderr
        host = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        assert "198.19.7." not in host


def test_a_cut_cable_and_a_power_cut():
    with nodes.NamespaceCluster(2) as cluster:
        node0, node1 = cluster.nodes
        node1.disconnect()
        cut = _python(node0, CONNECT, "node1")
        assert cut.returncode != 0, cut.stdout
        assert "timed out" in cut.stderr or "No route to host" in cut.stderr, cut.stderr
        node1.reconnect()
        sleeper = node1.popen(["sleep", "300"])
        assert sleeper.pid in node1.pids()  # ip netns exec and unshare exec: no fork
        node1.kill()
        assert sleeper.wait(timeout=10) == -9 and node1.pids() == []


def test_everything_is_removed_even_after_the_creator_died(tmp_path):
    with nodes.NamespaceCluster(2) as cluster:
        made = [n.namespace for n in cluster.nodes] + [cluster.switch]
        assert all(Path("/etc/netns", name, "hosts").is_file() for name in made[:2])
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in made)
    assert not any(Path("/etc/netns", name).exists() for name in made)
    # A test run killed with -9 leaves its namespaces: the next cluster removes them.
    orphan = subprocess.run(
        [sys.executable, "-c", "import os\nfrom mtcore.testing import nodes\n"
         "c = nodes.NamespaceCluster(1).__enter__()\nprint(c.nodes[0].namespace, flush=True)\n"
         "os._exit(0)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    left = orphan.stdout.strip()
    assert left in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert left in nodes.remove_orphans()
    assert (
        left not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match=r"outside 198\.18\.0\.0/15"):
        nodes.NamespaceCluster(2, subnet="10.0.0.0/24")
    with pytest.raises(ValueError, match="no room for 5 nodes"):
        nodes.NamespaceCluster(5, subnet="198.18.0.0/30")
