"""Check this installation: plugins, backends, and what each available backend provides.

Prints the versions in use, every plugin (broken ones with their error), the
model families a config can select, every backend with its availability (and why not) and its notes, then for each
available backend, or only the one named with --backend: device capabilities,
collectives (native or fallback per op and dtype), FP8 support, and which
implementation serves each kernel op.

Exit status: 0 when the installation is healthy, even if some backends are
unavailable here (a cuda plugin on a CPU machine); 1 when a plugin is broken
(it failed to import, a hook raised, or a kernel breaks its op's contract), when
several plugins claim one backend, or when the backend named with --backend
cannot be built here; the ERROR line on stderr says which. 2 on bad usage,
an unknown --backend name included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mtcore.cli import render

HELP = "check plugins, backends, capabilities and the kernel table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        metavar="NAME",
        help="inspect only this backend; exit 1 if it cannot be built here",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        metavar="HOST[:PORT]",
        help="a multi-node job's rendezvous (default: PET_RDZV_ENDPOINT): how this node "
        "reaches it, whether it listens, and the address the ranks bind",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for CI)")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show full tracebacks of broken plugins and failed backends",
    )


def run(args: argparse.Namespace) -> int:
    endpoint = args.rdzv_endpoint or os.environ.get("PET_RDZV_ENDPOINT")
    if endpoint:
        from mtcore.cli.launch import LaunchError, parse_endpoint

        where = "--rdzv-endpoint" if args.rdzv_endpoint else "PET_RDZV_ENDPOINT"
        try:
            endpoint = parse_endpoint(endpoint, where)
        except LaunchError as e:  # a typo, not an unhealthy node: said before anything
            print(f"mtcore doctor: error: {e}", file=sys.stderr)
            return 2
    data = collect(args.backend, verbose=args.verbose)
    # A name no plugin provides is a typo (usage, exit 2), not an unhealthy installation.
    names = {b["name"] for b in data["backends"]} | {c["backend"] for c in data["conflicts"]}
    unknown = args.backend is not None and args.backend not in names
    if endpoint:
        data["rendezvous"] = rendezvous_facts(
            endpoint, args.rdzv_endpoint is None, _interface_variables(args.backend)
        )
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(render.doctor_text(data, verbose=args.verbose))
    rendezvous = data.get("rendezvous")
    if data["error"] is None and rendezvous is not None and rendezvous["problems"]:
        data["error"] = {
            "message": f"this node is not ready for a multi-node job: {rendezvous['problems'][0]}",
            "traceback": "",
        }
    if data["error"] is not None:
        # On stderr in both modes: with --json, stdout stays one JSON document.
        print(f"\nERROR: {data['error']['message']}", file=sys.stderr)
        if args.verbose:
            print(data["error"]["traceback"], file=sys.stderr)
        return 2 if unknown else 1
    return 0


def collect(requested: str | None, verbose: bool = False) -> dict:
    """The whole report as JSON-ready data; ``error`` is set when ``requested`` cannot be built.

    A backend's own diagnostics may take seconds (they may import a compiler), so
    they run for the backends inspected in detail, or for every backend with --verbose.
    """
    from mtcore.backend import BackendError
    from mtcore.cli import report

    registry = report.load_registry()
    data = report.header_facts()
    data.update(
        command="doctor",
        requested=requested,
        plugins=[],
        skipped_plugins=report.skipped_plugin_facts(registry),
        backends=report.backend_summaries(registry),
        conflicts=report.conflict_facts(registry),
        selection=report.selection_facts(registry),
        models=report.family_facts(),
        error=None,
    )
    if requested is not None:
        targets = [requested]
    else:
        targets = [b["name"] for b in data["backends"] if b["available"]]
    by_name = {b["name"]: b for b in data["backends"]}
    for name in targets:
        try:
            backend = report.build_backend(registry, name)
        except BackendError as exc:
            facts = report.error_facts(exc)
            if name in by_name and by_name[name]["available"]:
                by_name[name]["error"] = facts  # unavailable ones already say why
            if requested is not None:
                data["error"] = facts
            continue
        by_name[name]["details"] = report.backend_details(backend)
    # After the builds: a plugin whose kernels break their op's contract is found there.
    data["plugins"] = report.plugin_facts(registry)
    if data["error"] is None:
        data["error"] = report.installation_error(data)
    data["self_checks"] = self_check_facts()
    specs = {name: spec for name, (spec, _) in registry.discovery.backends.items()}
    for entry in data["backends"]:
        if verbose or entry["details"] is not None:
            entry["diagnostics"] = report.diagnostic_facts(specs[entry["name"]])
    return data


def _interface_variables(requested: str | None) -> tuple[str, ...]:
    """The interface variables of the backend a job would use here (gloo's if none builds)."""
    from mtcore.backend import BackendError, select_backend
    from mtcore.backend.network import GLOO_VARIABLE

    try:
        return select_backend(requested).collective.interface_variables
    except BackendError:
        return (GLOO_VARIABLE,)


def rendezvous_facts(endpoint: str, from_environment: bool, variables: tuple[str, ...]) -> dict:
    """How this node reaches a multi-node job's rendezvous (one TCP connection, no data), and
    the addresses its ranks would bind (``variables``: the backend's interface variables)."""
    import socket

    from mtcore.backend import network

    host, _, port = endpoint.rpartition(":")  # parse_endpoint's HOST:PORT
    route = network.route_to(host, int(port))
    problems = [route.problem] if route.problem else []
    if route.source is not None:
        via = f" via {route.interface}" if route.interface else ""
        described = f"{host} is {route.address}, reached from {route.source}{via}"
    else:
        described = "none"
    binds = network.bindings(variables)
    for binding in binds:
        if binding.problem:
            problems.append(f"{binding.variable}: {binding.problem}")
        elif binding.address and route.source and binding.address != route.source:
            problems.append(
                f"{binding.variable}: the ranks bind {binding.address} ({binding.interface}), but "
                f"{host} is reached from {route.source} ({route.interface}): set "
                f"{binding.variable}={route.interface} unless the other nodes route to it"
            )
    refused = network.probe_endpoint(host, int(port)) if route.source is not None else None
    listening = (
        "listening (a job's agent hosts it)" if refused is None else f"not listening: {refused}"
    )
    return {
        "endpoint": f"{host}:{port}",
        "source": "PET_RDZV_ENDPOINT" if from_environment else "--rdzv-endpoint",
        "hostname": socket.gethostname(),
        "route": described,
        "listening": listening if route.source is not None else "not probed (no route)",
        "binds": [binding.describe() for binding in binds],
        "problems": problems,
    }


def self_check_facts() -> list[dict]:
    """The last backend self-checks `mtcore train` ran on this machine (newest first)."""
    from dataclasses import asdict

    from mtcore.backend.checks.selfcheck import last_results

    return [asdict(result) for result in last_results()]
