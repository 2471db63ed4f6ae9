"""The multi-node flags of `mtcore train` and `mtcore doctor`, checked before anything
starts: one line naming the flag, where torch's agent would fail with a traceback or,
for an endpoint with a URL scheme, try to reach a host called ``tcp``."""

from __future__ import annotations

import pytest

from mtcore.cli.launch import LaunchError, parse_endpoint, read_launch

BASE = {"--nproc": "2", "--nnodes": "2", "--rdzv-id": "job"}


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [("node0", "node0:29400"), ("node0:29500", "node0:29500"), ("10.1.2.3", "10.1.2.3:29400"),
     ("[fd00::1]:29500", "[fd00::1]:29500"), ("[fd00::1]", "[fd00::1]:29400"),
     ("gpu-node_7.cluster", "gpu-node_7.cluster:29400")],
)  # fmt: skip
def test_endpoints_that_work(text, endpoint):
    assert parse_endpoint(text, "--rdzv-endpoint") == endpoint


@pytest.mark.parametrize(
    ("text", "said"),
    [("tcp://node0:29400", "without a scheme: drop 'tcp://'"),
     ("node0:notaport", "needs HOST or HOST:PORT"), ("node0:0", "a port in 1-65535"),
     ("node0:70000", "a port in 1-65535"), ("fd00::1", "an IPv6 address in brackets"),
     ("node 0", "needs HOST or HOST:PORT"), (":29400", "needs HOST or HOST:PORT"),
     ("node0/x:29400", "needs HOST or HOST:PORT")],
)  # fmt: skip
def test_endpoints_refused_in_one_line(text, said):
    with pytest.raises(LaunchError, match=f"^--rdzv-endpoint .*{said}".replace("(", r"\(")):
        read_launch({**BASE, "--rdzv-endpoint": text}, environ={})


@pytest.mark.parametrize(
    ("conf", "said"),
    [("join_timeout=abc", "join_timeout needs whole seconds (>= 1), got 'abc'"),
     ("last_call_timeout=0", "last_call_timeout needs whole seconds (>= 1), got '0'"),
     ("read_timeout=1.5", "read_timeout needs whole seconds"),
     ("keep_alive_max_attempt=-1", "keep_alive_max_attempt needs a whole number"),
     ("is_host=maybe", "is_host needs true or false, got 'maybe'"),
     ("join_timeout=10,join_timeout=20", "join_timeout is given twice"),
     ("join_timeout", "needs KEY=VALUE")],
)  # fmt: skip
def test_rendezvous_settings_torch_would_fail_on(conf, said):
    flags = {**BASE, "--rdzv-endpoint": "node0", "--rdzv-conf": conf}
    with pytest.raises(LaunchError, match=r"^--rdzv-conf") as raised:
        read_launch(flags, environ={})
    assert said in str(raised.value)


def test_rendezvous_settings_that_work_pass_on_to_torch():
    conf = "join_timeout=600,last_call_timeout=10,is_host=false,protocol=https"
    launch = read_launch({**BASE, "--rdzv-endpoint": "node0", "--rdzv-conf": conf}, environ={})
    assert f"--rdzv-conf={conf}" in launch.torchrun_arguments()


def test_the_environment_is_named_when_it_holds_the_bad_value():
    environ = {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "tcp://node0", "PET_RDZV_ID": "j"}
    with pytest.raises(LaunchError, match=r"^PET_RDZV_ENDPOINT \(for --rdzv-endpoint\) takes"):
        read_launch({"--nproc": "2"}, environ=environ)


def test_doctor_refuses_a_malformed_endpoint_before_looking_at_anything(capsys):
    """`mtcore doctor --rdzv-endpoint host:notaport` is a usage error (exit 2, one line),
    not a node that is "not ready" because the name "does not resolve" (exit 1)."""
    from mtcore.cli.main import main

    assert main(["doctor", "--rdzv-endpoint", "node0:notaport"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("mtcore doctor: error: --rdzv-endpoint needs HOST or HOST:PORT (a port in "
                   "1-65535; an IPv6 address in brackets), got 'node0:notaport'")  # fmt: skip


def test_nodes_that_start_different_numbers_of_ranks_are_named_by_each_node():
    """``--nproc 2`` on one node and ``--nproc 1`` on the other: torch's agent numbers the
    three ranks anyway; each node finds the mismatch from the sizes it sets its ranks."""
    from mtcore.training.rank import nodes_disagree

    two = {"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}
    one = {**two, "LOCAL_WORLD_SIZE": "1"}
    for environ, local in ((two, 2), (one, 1)):
        said = nodes_disagree(environ)
        assert said is not None and said.startswith("--nproc differs across the nodes"), said
        assert f"starts {local} rank(s), but the 2 nodes start 3 in all" in said
    assert nodes_disagree({**two, "WORLD_SIZE": "4"}) is None
    assert nodes_disagree({}) is None  # not under an agent


def test_the_socket_error_inside_torchs_rendezvous_error_is_what_is_said():
    from mtcore.cli.launch import _network_cause

    inner = RuntimeError(
        "The client socket has failed to connect to any network address of (198.18.0.1, "
        "29400). The client socket has failed to connect to 1.2.3.4:5 (errno: 101 - Network "
        "is unreachable)."
    )
    try:
        raise RuntimeError("The connection to the C10d store has failed. See inner exception") from inner
    except RuntimeError as outer:
        assert _network_cause(outer) == "errno: 101 - Network is unreachable"
    assert _network_cause(RuntimeError("timed out\nmore")) == "timed out"
