"""Which address a node's ranks bind between nodes (``mtcore.backend.network``), read from this
host's real interfaces and resolver: loopback always exists, so the rules are checked on it."""

from __future__ import annotations

import socket

from mtcore.backend import network


def test_interfaces_include_loopback():
    assert network.interface_addresses()["lo"] == "127.0.0.1"


def test_gloo_takes_the_named_interface_and_says_when_it_is_missing():
    named = network.gloo_binding({"GLOO_SOCKET_IFNAME": "lo"})
    assert (named.address, named.interface, named.problem) == ("127.0.0.1", "lo", None)
    assert named.describe() == "GLOO_SOCKET_IFNAME=lo: binds 127.0.0.1 (lo), as the variable names"
    missing = network.gloo_binding({"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert missing.address is None and "no interface nosuch0" in missing.problem


def test_gloo_without_the_variable_uses_the_host_name_or_falls_back_to_loopback():
    # A name that resolves to loopback: the classic /etc/hosts line; other nodes cannot connect.
    fallback = network.gloo_binding({}, hostname="localhost")
    assert fallback.address == "127.0.0.1" and "loopback" in fallback.how
    assert "set GLOO_SOCKET_IFNAME" in fallback.problem
    # A name for an address this host does not have (an IP literal: no resolver traffic).
    elsewhere = network.gloo_binding({}, hostname="203.0.113.7")
    assert elsewhere.address == "127.0.0.1" and "resolves to no address of this host" in elsewhere.how
    here = network.gloo_binding({}, hostname=socket.gethostname())
    addresses = network.interface_addresses()
    assert here.address in addresses.values()
    assert (here.problem is None) == (here.interface != "lo")


def test_nccl_style_selection_by_prefix_exclusion_and_exact_name():
    lo = network.library_binding("NCCL_SOCKET_IFNAME", {"NCCL_SOCKET_IFNAME": "l"})
    assert (lo.interface, lo.address) == ("lo", "127.0.0.1")  # a prefix
    exact = network.library_binding("NCCL_SOCKET_IFNAME", {"NCCL_SOCKET_IFNAME": "=l"})
    assert exact.address is None and "selects no interface" in exact.problem
    others = sorted(set(network.interface_addresses()) - {"lo"})
    excluded = network.library_binding("MCCL_SOCKET_IFNAME", {"MCCL_SOCKET_IFNAME": "^lo"})
    assert excluded.interface == (others[0] if others else None)
    unset = network.library_binding("NCCL_SOCKET_IFNAME", {})
    assert unset.address is None and unset.problem is None and "own choice" in unset.how


def test_a_route_and_a_probe_to_a_port_nobody_listens_on():
    with socket.socket() as reserved:  # a free port, closed again: nothing listens there
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
    route = network.route_to("localhost", port)
    assert (route.address, route.source, route.interface) == ("127.0.0.1", "127.0.0.1", "lo")
    assert network.probe_endpoint("127.0.0.1", port) is not None  # refused
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert network.probe_endpoint("127.0.0.1", listening.getsockname()[1]) is None
