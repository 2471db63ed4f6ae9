"""Several "nodes" on one Linux host, for tests of what crosses a machine boundary.

Each node is a network namespace with one interface, ``eth0``, plugged into a
bridge that lives in a namespace of its own (the switch), and an address the
cluster assigns in 198.18.0.0/15, the range reserved for network benchmarks
(RFC 2544). A node has no route beyond its subnet, and the host's namespace has
no interface on it, so traffic stays between the cluster's nodes: an address
outside is unreachable from a node, and a node is unreachable from the host.

A process started on a node (``Node.popen``) also gets the node's hostname
(its own UTS namespace; every node's ``/etc/hosts`` names all of them, so
``node0`` resolves on every node as a cluster's DNS would) and the node's own
``/dev/shm``: ranks on two nodes cannot share memory, as on two machines. The
file system is shared, as a cluster's shared storage is.

Failures are made the way a cluster has them: ``Node.kill`` is a power cut
(SIGKILL to every process in the node's namespace), ``Node.disconnect`` pulls
the cable (the switch side of its link goes down; its processes live on).

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); ``unavailable()``
says why not when they are missing, so tests can skip with that line.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
DEFAULT_SUBNET = "198.18.0.0/24"
INTERFACE = "eth0"
# How long a process started on a node may take to enter its namespace (ip netns exec).
ENTER_PATIENCE_S = 5.0
# Namespaces are named mtc<creator pid>-<cluster>-<role>, so a cluster whose creator died
# (kill -9 of a test run) is found and removed by the next one.
_PREFIX = "mtc"
_OWNED = re.compile(rf"^{_PREFIX}(\d+)-")
_NETNS_ETC = Path("/etc/netns")


class NodesUnavailable(RuntimeError):
    """This host cannot make namespace nodes; the message says why."""


def unavailable() -> str | None:
    """Why namespace nodes cannot be made here (one line), or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"namespace nodes need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "namespace nodes need root (ip netns add, veth, unshare --uts)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"namespace nodes need `{tool}` ({package}), which is not on PATH"
    probe = f"{_PREFIX}{os.getpid()}-probe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Node:
    """One node: its hostname, address and namespace, and the processes started on it."""

    index: int
    hostname: str
    address: str
    namespace: str
    cluster: NamespaceCluster
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def interface(self) -> str:
        return INTERFACE

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs on this node (its network, hostname, /dev/shm)."""
        shm = self.cluster.shm_dir(self)
        setup = f'hostname {self.hostname} && mount --bind {shm} /dev/shm && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
            "sh",
            "-c",
            setup,
            "sh",
        ] + [str(a) for a in argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this node (keywords as for ``subprocess.Popen``); returns once
        the process runs inside the node's namespace (or has ended), so that a power cut
        right after cannot miss it."""
        process = subprocess.Popen(self.command(argv), **kwargs)
        self.processes.append(process)
        deadline = time.monotonic() + ENTER_PATIENCE_S
        while process.poll() is None and process.pid not in self.pids():
            if time.monotonic() > deadline:
                raise NodesUnavailable(
                    f"{self.hostname}: process {process.pid} did not enter the namespace "
                    f"{self.namespace} within {ENTER_PATIENCE_S:g} s"
                )
            time.sleep(0.01)
        return process

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on this node to the end (keywords as for ``subprocess.run``)."""
        return subprocess.run(self.command(argv), **kwargs)

    def pids(self) -> list[int]:
        """Every process in this node's network namespace."""
        listed = _ip("netns", "pids", self.namespace, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]

    def kill(self, patience_s: float = 10.0) -> None:
        """A power cut: SIGKILL to every process on the node, until none is left."""
        deadline = time.monotonic() + patience_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise NodesUnavailable(f"{self.hostname}: processes {pids} survive SIGKILL")
            time.sleep(0.05)
        for process in self.processes:
            try:
                process.wait(timeout=patience_s)
            except subprocess.TimeoutExpired:
                process.kill()

    def disconnect(self) -> None:
        """Pull the cable: the switch side of the node's link goes down."""
        self.cluster.switch_ip("link", "set", self.cluster.port(self), "down")

    def reconnect(self) -> None:
        self.cluster.switch_ip("link", "set", self.cluster.port(self), "up")


class NamespaceCluster:
    """``count`` nodes joined by one switch; a context manager that removes everything it made.

    ``subnet``: where the addresses come from (a /24 or smaller, inside 198.18.0.0/15);
    node ``i`` is ``node<i>`` at the subnet's ``i + 1``-th address.
    """

    def __init__(self, count: int = 2, subnet: str = DEFAULT_SUBNET):
        if count < 1:
            raise ValueError(f"a cluster needs at least one node, not {count}")
        network = ipaddress.ip_network(subnet)
        if not network.subnet_of(BENCHMARK_RANGE):
            raise ValueError(f"subnet {subnet} is outside {BENCHMARK_RANGE} (RFC 2544's range)")
        if network.num_addresses - 2 < count:
            raise ValueError(f"subnet {subnet} has no room for {count} nodes")
        self.network = network
        self.tag = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.tag}-sw"
        hosts = list(network.hosts())
        self.nodes = [
            Node(i, f"node{i}", str(hosts[i]), f"{self.tag}-n{i}", self) for i in range(count)
        ]
        self._scratch: Path | None = None

    # -- set up and tear down ---------------------------------------------------------
    def __enter__(self) -> NamespaceCluster:
        reason = unavailable()
        if reason is not None:
            raise NodesUnavailable(reason)
        remove_orphans()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        _ip("netns", "add", self.switch)
        self.switch_ip("link", "add", "br0", "type", "bridge")
        self.switch_ip("link", "set", "br0", "up")
        # IPv4-mapped forms too: c10d looks its peers up by the address of an IPv6 socket.
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{node.address} {node.hostname}\n::ffff:{node.address} {node.hostname}\n"
            for node in self.nodes
        )
        for node in self.nodes:
            _ip("netns", "add", node.namespace)
            # Created in the switch's namespace, so the host's never holds either end.
            self.switch_ip(
                "link", "add", self.port(node), "type", "veth",
                "peer", "name", INTERFACE, "netns", node.namespace,
            )  # fmt: skip
            self.switch_ip("link", "set", self.port(node), "master", "br0")
            self.switch_ip("link", "set", self.port(node), "up")
            prefix = f"{node.address}/{self.network.prefixlen}"
            _ip("-n", node.namespace, "addr", "add", prefix, "dev", INTERFACE)
            _ip("-n", node.namespace, "link", "set", INTERFACE, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            etc = _NETNS_ETC / node.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            self.shm_dir(node).mkdir(mode=0o1777)

    def close(self) -> None:
        """Stop every process on the nodes and remove the namespaces, files and links."""
        for node in self.nodes:
            with contextlib.suppress(NodesUnavailable):
                node.kill()
        for namespace in [node.namespace for node in self.nodes] + [self.switch]:
            _ip("netns", "del", namespace, check=False)
            shutil.rmtree(_NETNS_ETC / namespace, ignore_errors=True)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    # -- helpers ------------------------------------------------------------------------
    def port(self, node: Node) -> str:
        """The switch's end of ``node``'s link (an interface name, 15 characters at most)."""
        return f"port{node.index}"

    def shm_dir(self, node: Node) -> Path:
        assert self._scratch is not None, "the cluster is not set up"
        return self._scratch / f"shm-{node.hostname}"

    def switch_ip(self, *args: str) -> subprocess.CompletedProcess:
        return _ip("-n", self.switch, *args)

    @property
    def hosts(self) -> dict[str, str]:
        """hostname -> address of every node."""
        return {node.hostname: node.address for node in self.nodes}


def remove_orphans() -> list[str]:
    """Remove the namespaces (and their /etc/netns files) of clusters whose creator died."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listed:
        name = line.split(" ")[0]
        owner = _OWNED.match(name)
        if owner and not _alive(int(owner.group(1))):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(_NETNS_ETC / name, ignore_errors=True)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NodesUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done
