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
cannot be built; the ERROR line on stderr says which. 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys

from mtcore.cli import render

HELP = "check plugins, backends, capabilities and the kernel table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        metavar="NAME",
        help="inspect only this backend; exit 1 if it cannot be built here",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for CI)")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show full tracebacks of broken plugins and failed backends",
    )


def run(args: argparse.Namespace) -> int:
    data = collect(args.backend, verbose=args.verbose)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(render.doctor_text(data, verbose=args.verbose))
    if data["error"] is not None:
        # On stderr in both modes: with --json, stdout stays one JSON document.
        print(f"\nERROR: {data['error']['message']}", file=sys.stderr)
        if args.verbose:
            print(data["error"]["traceback"], file=sys.stderr)
        return 1
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
    specs = {name: spec for name, (spec, _) in registry.discovery.backends.items()}
    for entry in data["backends"]:
        if verbose or entry["details"] is not None:
            entry["diagnostics"] = report.diagnostic_facts(specs[entry["name"]])
    return data
