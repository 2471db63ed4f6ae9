"""List the installed mtcore plugins: one line each, with status and what it provides
(backends, kernels, model families).

Status is "ok" or "broken" (the plugin failed to import or its hook raised; run
`mtcore doctor --verbose` for the traceback). Exits 0 whenever the listing
itself worked, broken plugins included.
"""

from __future__ import annotations

import argparse
import json

HELP = "list installed plugins, their versions, status, backends and model families"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the list as JSON")


def run(args: argparse.Namespace) -> int:
    from mtcore.cli import report

    registry = report.load_registry()
    plugins = report.plugin_facts(registry)
    skipped = report.skipped_plugin_facts(registry)
    if args.json:
        print(
            json.dumps(
                {"schema": report.SCHEMA_VERSION, "plugins": plugins, "skipped": skipped}, indent=2
            )
        )
        return 0
    for line in plugin_lines(plugins):
        print(line)
    for entry in skipped:
        print(f"{entry['name']}  skipped: {entry['reason']}")
    if not plugins and not skipped:
        print("no mtcore plugins installed (entry point group 'mtcore.plugins')")
    return 0


def plugin_lines(plugins: list[dict]) -> list[str]:
    """``name  dist version  status  backends: ...`` aligned in columns."""
    rows = []
    for p in plugins:
        dist = f"{p['dist']} {p['version']}" if p["dist"] else "(not from a distribution)"
        provides = ", ".join(p["backends"]) or "none"
        if p["conflicting_backends"]:
            provides += "; in conflict: " + ", ".join(p["conflicting_backends"])
        if p["kernels"]:
            provides += "; contributes kernels"
        if p.get("families"):
            provides += "; model families: " + ", ".join(p["families"])
        tail = f"backends: {provides}"
        if p["error"] is not None:
            tail = f"error: {p['error']['type']}: {_first_line(p['error']['message'])}"
        rows.append((p["name"], dist, p["status"], tail))
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
        for r in rows
    ]


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""
