"""Which address a node's ranks bind, and whether the rendezvous can be reached from here.

On one host every rank talks over loopback; across nodes each rank must bind an
address the other nodes reach. gloo picks it from ``GLOO_SOCKET_IFNAME`` (one
interface, or several separated by commas), else from this host's name: the
address the name resolves to, and loopback when the name resolves to none of
this host's addresses (a classic ``/etc/hosts`` line ``127.0.1.1 node1`` makes
every other node fail to connect). NCCL and MCCL read ``NCCL_SOCKET_IFNAME`` /
``MCCL_SOCKET_IFNAME`` (prefixes of interface names, ``^`` to exclude, ``=``
for exact names) and otherwise pick an interface themselves. A backend's
collective names the variables its traffic obeys (``Collective.interface_variables``).

Everything here reads local state (interfaces, the resolver, the routing table)
and sends nothing, except ``probe_endpoint``, which opens one TCP connection.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass

GLOO_VARIABLE = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_addresses() -> dict[str, str]:
    """Interface name -> its IPv4 address, for every interface that has one (Linux)."""
    if not sys.platform.startswith("linux"):
        return {}
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


@dataclass(frozen=True)
class Binding:
    """What the ranks of this node bind for one collective library."""

    variable: str  # the environment variable that chooses the interface
    value: str | None  # its value here (None: unset)
    address: str | None  # the address the ranks bind (None: the library picks at run time)
    interface: str | None
    how: str  # one phrase: why this address
    problem: str | None = None  # what will fail across nodes, with the fix

    def describe(self) -> str:
        setting = f"{self.variable}={self.value}" if self.value else f"{self.variable} unset"
        where = (
            f"{self.address} ({self.interface})"
            if self.address and self.interface
            else self.address
        )
        line = f"{setting}: binds {where or 'an address the library picks'}, {self.how}"
        return line + (f"; across nodes: {self.problem}" if self.problem else "")


def gloo_binding(environ=None, hostname: str | None = None) -> Binding:
    """The address gloo's ranks bind on this node (torch's ``ProcessGroupGloo`` rules)."""
    environ = os.environ if environ is None else environ
    value = environ.get(GLOO_VARIABLE) or None
    addresses = interface_addresses()
    if value is not None:
        names = [name.strip() for name in value.split(",") if name.strip()]
        missing = [name for name in names if name not in addresses]
        if missing:
            return Binding(
                GLOO_VARIABLE, value, None, None, "as the variable names",
                f"no interface {', '.join(missing)} with an IPv4 address here "
                f"(this node has {', '.join(sorted(addresses)) or 'none'})",
            )  # fmt: skip
        first = names[0]
        more = f" (and {', '.join(names[1:])})" if len(names) > 1 else ""
        return Binding(
            GLOO_VARIABLE, value, addresses[first], first, f"as the variable names{more}"
        )
    hostname = hostname or socket.gethostname()
    try:
        resolved = socket.gethostbyname(hostname)
    except OSError:
        resolved = None
    by_address = {address: name for name, address in addresses.items()}
    if resolved is not None and resolved in by_address and not _loopback(resolved):
        return Binding(
            GLOO_VARIABLE, None, resolved, by_address[resolved],
            f"the address this host's name {hostname!r} resolves to",
        )  # fmt: skip
    why = (
        f"this host's name {hostname!r} resolves to {resolved}, a loopback address"
        if resolved is not None and _loopback(resolved)
        else f"this host's name {hostname!r} resolves to no address of this host ({resolved})"
    )
    return Binding(
        GLOO_VARIABLE, None, "127.0.0.1", "lo", f"the loopback fallback: {why}",
        f"ranks on other nodes cannot reach loopback; set {GLOO_VARIABLE} to the interface "
        "the nodes share, or make the host name resolve to its address",
    )  # fmt: skip


def library_binding(variable: str, environ=None) -> Binding:
    """NCCL-style selection (``NCCL_SOCKET_IFNAME``, ``MCCL_SOCKET_IFNAME``): prefixes of
    interface names, ``^`` to exclude them, ``=`` for exact names."""
    environ = os.environ if environ is None else environ
    value = environ.get(variable) or None
    addresses = interface_addresses()
    if value is None:
        return Binding(
            variable, None, None, None,
            "the library's own choice (InfiniBand first, then any interface but lo and docker*)",
        )  # fmt: skip
    exclude, exact, text = value.startswith("^"), False, value.lstrip("^")
    if text.startswith("="):
        exact, text = True, text[1:]
    wanted = [part for part in text.split(",") if part]

    def matches(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    chosen = sorted(name for name in addresses if matches(name) != exclude)
    if not chosen:
        return Binding(
            variable, value, None, None, "as the variable selects",
            f"it selects no interface with an IPv4 address here "
            f"(this node has {', '.join(sorted(addresses)) or 'none'})",
        )  # fmt: skip
    return Binding(variable, value, addresses[chosen[0]], chosen[0], "as the variable selects")


def bindings(interface_variables: tuple[str, ...], environ=None) -> list[Binding]:
    """One ``Binding`` per variable a backend's collective traffic obeys."""
    return [
        gloo_binding(environ) if variable == GLOO_VARIABLE else library_binding(variable, environ)
        for variable in interface_variables
    ]


@dataclass(frozen=True)
class Route:
    """How this node reaches ``host``: its address and the local source address and interface
    the kernel would use (no packet is sent)."""

    host: str
    address: str | None
    source: str | None
    interface: str | None
    problem: str | None = None


def route_to(host: str, port: int) -> Route:
    try:
        address = socket.gethostbyname(host)
    except OSError as e:
        return Route(host, None, None, None, f"{host!r} does not resolve here: {e}")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect((address, port))  # picks a route; a datagram socket sends nothing
            source = udp.getsockname()[0]
    except OSError as e:
        return Route(host, address, None, None, f"no route to {address}: {e.strerror or e}")
    interface = next((n for n, a in interface_addresses().items() if a == source), None)
    return Route(host, address, source, interface)


def probe_endpoint(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """None when a TCP connection to ``host:port`` opens (the rendezvous is listening), else why
    not, in a few words."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
