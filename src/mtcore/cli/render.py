"""Text rendering of the doctor report (the data comes from ``mtcore.cli.report``)."""

from __future__ import annotations

import shutil
import textwrap

from mtcore.cli.plugins import plugin_lines

WIDTH = min(max(shutil.get_terminal_size((100, 24)).columns, 80), 120)


def rule(title: str, char: str = "=") -> str:
    title = f" {title} "
    left = (WIDTH - len(title)) // 2
    return char * left + title + char * (WIDTH - left - len(title))


def indent(text: str, prefix: str = "    ") -> str:
    return textwrap.indent(text.rstrip("\n"), prefix)


def gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"


def doctor_text(data: dict, verbose: bool = False) -> str:
    out: list[str] = [rule("mtcore doctor")]
    out += _header(data)
    out += _plugins(data, verbose)
    out += _families(data)
    out += _backends(data, verbose)
    if data.get("rendezvous") is not None:
        out += _rendezvous(data["rendezvous"])
    out += _self_checks(data.get("self_checks", []))
    for backend in data["backends"]:
        if backend["details"] is not None:
            out += _details(backend)
    out.append(rule(_summary(data)))
    return "\n".join(out)


def _header(data: dict) -> list[str]:
    lines = [
        f"platform {data['platform']} -- Python {data['python']}, mtcore-{data['mtcore']}, "
        f"torch-{data['torch']}, pluggy-{data['pluggy']}",
        f"python: {data['python_executable']}",
    ]
    env = [f"{k}={v}" for k, v in data["env"].items() if v is not None]
    lines.append("environment: " + (" ".join(env) if env else "no MTCORE_* variables set"))
    return [*lines, ""]


def _plugins(data: dict, verbose: bool) -> list[str]:
    plugins = data["plugins"]
    broken = [p for p in plugins if p["status"] == "broken"]
    lines = [f"plugins: {len(plugins) - len(broken)} loaded, {len(broken)} broken"]
    lines += ["  " + line for line in plugin_lines(plugins)]
    for p in broken:  # always with the traceback: it is what the plugin's author needs
        lines.append(f"  traceback of {p['name']}:")
        lines.append(indent(p["error"]["traceback"]))
    for s in data["skipped_plugins"]:
        lines.append(f"  {s['name']}  skipped: {s['reason']}")
    if not plugins and not data["skipped_plugins"]:
        lines.append("  none")
    return [*lines, ""]


def _families(data: dict) -> list[str]:
    models = data["models"]
    lines = [f"model families: {len(models['families'])}"]
    for f in models["families"]:
        extras = [f"hf: {', '.join(f['hf'])}" if f["hf"] else "no hf adapter"]
        extras.append("generates" if f["generates"] else "no generation")
        lines.append(f"  {f['name']:<8} {f['source']:<9} {f['description']} ({'; '.join(extras)})")
    if models["error"] is not None:
        lines.append(f"  ERROR: {models['error']['message']}")
    return [*lines, ""]


def _backends(data: dict, verbose: bool) -> list[str]:
    backends = data["backends"]
    sel = data["selection"]
    if sel["error"] is None:
        lines = [f"backends: {len(backends)} found, default {sel['backend']} ({sel['how']})"]
    else:
        first = sel["error"]["message"].splitlines()[0]
        lines = [f"backends: {len(backends)} found, no default ({sel['how']})"]
        lines += wrap(f"ERROR: {first}", "  ", "         ")
    for note in sel.get("notes", []):
        lines += wrap(f"WARNING: {note}", "  ", "           ")
    width = max((len(b["name"]) for b in backends), default=0)
    pad = " " * (width + 4)
    for b in backends:
        role = f"priority {b['priority']}" if b["accelerator"] else "host"
        state = "available" if b["available"] else f"unavailable: {b['reason']}"
        lines += wrap(
            f"{b['name'].ljust(width)}  [{b['plugin']}, {role}]  {state}", "  ", pad + "  "
        )
        if b["description"]:
            lines += wrap(b["description"], pad)
        for note in b["notes"]:
            lines += wrap(f"NOTE: {note}", pad, pad + "      ")
        for label, value in (b["diagnostics"] or {}).items():
            lines += wrap(f"{label}: {value}", pad, pad + "  ")
        if b["error"] is not None:
            lines += wrap(f"ERROR: {b['error']['message']}", pad, pad + "       ")
            if verbose:
                lines.append(indent(b["error"]["traceback"], pad + "  "))
    if not backends:
        lines.append("  none")
    for c in data["conflicts"]:
        owners = ", ".join(f"{p['name']} ({p['dist']} {p['version']})" for p in c["plugins"])
        text = (
            f"CONFLICT: backend {c['backend']!r} is claimed by {owners}; it cannot be "
            "selected until one is uninstalled or left out with MTCORE_PLUGINS"
        )
        lines += wrap(text, "  ", "            ")
    return [*lines, ""]


def wrap(text: str, first: str, rest: str | None = None) -> list[str]:
    """Lines of at most WIDTH columns; each paragraph of ``text`` starts a new line."""
    lines: list[str] = []
    for i, para in enumerate(text.splitlines() or [""]):
        start = first if i == 0 else (rest if rest is not None else first)
        lines += textwrap.wrap(
            para,
            WIDTH,
            initial_indent=start,
            subsequent_indent=rest if rest is not None else first,
            break_long_words=False,
            break_on_hyphens=False,
        ) or [start.rstrip()]
    return lines


def _details(backend: dict) -> list[str]:
    details = backend["details"]
    lines = [rule(f"backend {backend['name']}", "-")]
    lines += _section("device", details["capabilities"], _capabilities)
    lines += _section("collective", details["collective"], _collective)
    lines += _section("fp8", details["fp8"], _fp8)
    lines += _section("kernels", details["kernels"], _kernels)
    return lines


def _section(title: str, facts: dict, fn) -> list[str]:
    if "error" in facts:
        return [f"{title}: ERROR {facts['error']['type']}: {facts['error']['message']}", ""]
    return [*fn(facts), ""]


def _capabilities(c: dict) -> list[str]:
    peak = ", ".join(
        f"{k} {'unknown' if v is None else f'{v:g}'}" for k, v in c["peak_tflops"].items()
    )
    cc = (
        f", capability {'.'.join(map(str, c['compute_capability']))}"
        if c["compute_capability"]
        else ""
    )
    return [
        f"device: {c['device_name']} (type {c['device_type']!r}, {c['device_count']} visible{cc})",
        f"  memory       {gib(c['memory_bytes'])}",
        f"  dtypes       {', '.join(c['dtypes'])}",
        f"  peak TFLOP/s {peak}",
    ]


def _self_checks(checks: list[dict]) -> list[str]:
    """The last self-check `mtcore train` ran per backend and dtype on this machine."""
    lines = ["self-checks by mtcore train here (training.self_check; newest first):"]
    if not checks:
        return [*lines, "  none yet: the first job on a backend runs one before step 1", ""]
    for c in checks:
        state = "passed" if not c["failures"] else f"FAILED: {'; '.join(c['failures'])}"
        if c.get("kind") == "collectives":  # one line per group: what was sent, how large
            what = f"collectives of {len(c['checked'])} group(s) ({'; '.join(c['checked'])})"
        else:
            what = f"{len(c['checked'])} kernel(s)"
        lines.append(f"  {c['backend']} {c['dtype']} at {c['when']}: {what}, {state}")
    return [*lines, ""]


def _rendezvous(r: dict) -> list[str]:
    lines = [f"multi-node: this node {r['hostname']}, rendezvous {r['endpoint']} ({r['source']})"]
    lines.append(f"  route: {r['route']}")
    lines.append(f"  rendezvous port: {r['listening']}")
    lines += [f"  ranks: {binding}" for binding in r["binds"]]
    lines += [f"  PROBLEM: {problem}" for problem in r["problems"]]
    return [*lines, ""]


def _collective(c: dict) -> list[str]:
    avg = "native" if c["avg_native"] else "emulated (sum, then divide)"
    lines = [f"collective: c10d backend {c['c10d_backend']!r}; ReduceOp.AVG {avg}"]
    if "shared_memory" in c:
        lines.append(
            f"  tensor-, data-, expert-parallel groups and pipeline transfers of one host "
            f"through shared memory: "
            f"{c['shared_memory']}"
        )
    for binding in c.get("between_nodes", []):
        lines.append(f"  between nodes: {binding}")
    ops = c["ops"]
    labels = list(next(iter(ops.values()))) if ops else []
    width = max(len(op) for op in ops) if ops else 0
    lines.append("  " + "".ljust(width) + "  " + "  ".join(label.ljust(9) for label in labels))
    for op, row in ops.items():
        lines.append(
            "  " + op.ljust(width) + "  " + "  ".join(row[label].ljust(9) for label in labels)
        )
    if any(v == "fallback" for row in ops.values() for v in row.values()):
        lines.append(
            "  fallback: data movement sends the raw bytes (uint8); reductions run in float32"
        )
    return [line.rstrip() for line in lines]


def _fp8(f: dict) -> list[str]:
    state = "available" if f["available"] else f"unavailable: {f['reason']}"
    formats = ", ".join(f"{k} ({v})" for k, v in f["formats"].items())
    lines = [f"fp8: {state}; formats {formats}"]
    width = max(len(g) for g in f["granularities"])
    why = f.get("why", {})
    for g, path in f["granularities"].items():
        text = f"{path}: {why[g]}" if g in why else path
        lines += wrap(text, f"  {g.ljust(width)}  ", " " * (width + 4))
    for source in f.get("path_sources", []):
        lines += wrap(f"paths {source}", "  ", "    ")
    pairs = ", ".join(f"{a} x {b}" for a, b in f["native_pairs"]) or "none"
    lines.append(f"  native scaled-matmul pairs (a x b): {pairs}")
    if "mixed_formats_native" in f and not f["mixed_formats_native"] and f["native_pairs"]:
        lines.append("  e5m2 x e4m3 (hybrid's gradient GEMMs): fallback (matmul in higher precision)")
    for recipe, gemms in f.get("recipes", {}).items():  # precision.fp8_recipe
        by_path: dict[str, list[str]] = {}
        for gemm, path in gemms.items():
            by_path.setdefault(path, []).append(gemm)
        paths = "; ".join(f"{', '.join(g)}: {path}" for path, g in by_path.items())
        lines.append(f"  recipe {recipe.ljust(9)}  {paths}")
    return lines


def _kernels(k: dict) -> list[str]:
    if k["forced_reference"]:
        head = (
            "kernels: MTCORE_KERNELS=reference forces the reference implementation of every op; "
            "plugin kernels below are bypassed"
        )
    else:
        head = "kernels: implementation [plugin] serving each op (MTCORE_KERNELS=reference forces the reference)"
    lines = wrap(head, "", "  ")
    for dtype, rows in k["dtypes"].items():
        lines.append(f"  {dtype}")
        width = max(len(op) for op in rows)
        for op, row in rows.items():
            chosen = " -> ".join(_impl(i) for i in row["chosen"])
            line = f"    {op.ljust(width)}  {chosen}"
            if row["others"]:
                line += "   also: " + ", ".join(
                    _other(i, k["forced_reference"]) for i in row["others"]
                )
            lines.append(line)
    if any(len(r["chosen"]) > 1 for rows in k["dtypes"].values() for r in rows.values()):
        lines.append(
            "  'a -> b': a serves the calls its shape guard (fallback_ok) accepts, b the rest"
        )
    return lines


def _impl(i: dict) -> str:
    return f"{i['name']} [{i['plugin']}]"


def _other(i: dict, forced: bool) -> str:
    if forced:
        why = "bypassed"
    elif i["reference"]:
        return _impl(i)
    elif i["accepts"] is True:
        why = f"priority {i['priority']}, outranked"
    elif i["accepts"] is False:
        why = "predicate declines"
    else:
        why = i["accepts"]
    return f"{_impl(i)} ({why})"


def _summary(data: dict) -> str:
    backends = data["backends"]
    available = [b["name"] for b in backends if b["available"]]
    broken = sum(p["status"] == "broken" for p in data["plugins"])
    parts = [f"{len(available)} of {len(backends)} backends available"]
    if available:
        parts[0] += f" ({', '.join(available)})"
    if broken:
        parts.append(f"{broken} broken plugin{'s' * (broken != 1)}")
    if data["conflicts"]:
        parts.append(f"{len(data['conflicts'])} conflict{'s' * (len(data['conflicts']) != 1)}")
    if data["error"] is not None:
        parts.append(f"--backend {data['requested']} failed")
    return ", ".join(parts)
