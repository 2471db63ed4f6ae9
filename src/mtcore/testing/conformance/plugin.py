"""pytest plugin of the conformance kit: the ``--mtcore-backend`` and ``--mtcore-area``
options and the summary.

Registered through the ``pytest11`` entry point of the ``mtcore`` distribution,
so it is loaded in every pytest session where mtcore is installed. It is inert
there: it adds two options and reports only on the kit's own tests. It imports
neither torch nor a backend until a kit test asks for one. Where plugin
autoloading is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), load it with
``-p mtcore.testing.conformance.plugin``.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

PACKAGE = "mtcore.testing.conformance"
_HERE = Path(__file__).resolve().parent
AREAS = ("device", "collective", "kernel", "fp8", "plugins")  # as the summary prints them
# Other names ``--mtcore-area`` accepts for an area.
AREA_ALIASES = {"kernels": "kernel"}
CAPABILITY = "capability:"
_MODULE_AREA = {
    f"{PACKAGE}.test_device": "device",
    f"{PACKAGE}.test_collective": "collective",
    f"{PACKAGE}.test_kernels": "kernel",
    f"{PACKAGE}.test_fp8": "fp8",
    f"{PACKAGE}.test_plugins": "plugins",
}


class KitState:
    """One session of the kit: the backend, cached spawn results, outcomes per area.

    Registered as a plugin object by ``pytest_configure`` so that its hooks see
    the session's config.
    """

    def __init__(self, config: pytest.Config):
        self.config = config
        self.backend = None  # mtcore.backend.Backend, built on first use
        self.collective: dict[int, object] = {}  # world size -> merged results or error text
        self.area_of: dict[str, str] = {}  # nodeid -> area
        self.outcome: dict[str, str] = {}  # nodeid -> passed / failed / skipped
        self.skip_reason: dict[str, str] = {}
        self.notes: dict[str, list[str]] = {}  # area -> lines
        self.error: str | None = None  # why the backend could not be selected
        self.areas: tuple[str, ...] = selected_areas(config)  # what --mtcore-area asks for

    @property
    def requested(self) -> str | None:
        option = getattr(self.config.option, "mtcore_backend", None)
        return option or os.environ.get("MTCORE_BACKEND") or None

    def note(self, area: str, line: str) -> None:
        lines = self.notes.setdefault(area, [])
        if line not in lines:
            lines.append(line)

    def pytest_collectstart(self, collector: pytest.Collector) -> None:
        # Select the backend before the kit's modules are collected, so that a
        # backend that cannot run stops the session with one message.
        if isinstance(collector, pytest.Package) and Path(collector.path).resolve() == _HERE:
            kit_backend(self.config)

    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        if self.areas == AREAS:
            return
        keep, drop = [], []
        for item in items:
            area = _MODULE_AREA.get(getattr(getattr(item, "module", None), "__name__", ""))
            (drop if area is not None and area not in self.areas else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:  # after deselection (-k, -m)
            module = getattr(item, "module", None)
            area = _MODULE_AREA.get(getattr(module, "__name__", ""))
            if area is not None:
                self.area_of[item.nodeid] = area

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self.area_of:
            return
        previous = self.outcome.get(report.nodeid)
        if report.failed:
            self.outcome[report.nodeid] = "failed"
        elif report.skipped and previous != "failed":
            self.outcome[report.nodeid] = "skipped"
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            self.skip_reason[report.nodeid] = reason.removeprefix("Skipped: ")
        elif report.when == "call" and report.passed and previous is None:
            self.outcome[report.nodeid] = "passed"

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.error is not None:
            terminalreporter.write_sep(
                "=", f"mtcore conformance: backend {self.requested or 'auto'}"
            )
            terminalreporter.write_line(f"not run: {self.error}", red=True)
        elif self.area_of:
            _summary(self, terminalreporter)


_STATE = pytest.StashKey[KitState]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mtcore", "mtcore conformance kit")
    group.addoption(
        "--mtcore-backend",
        dest="mtcore_backend",
        default=None,
        metavar="NAME",
        help="backend the conformance kit checks (default: $MTCORE_BACKEND, else automatic selection)",
    )
    group.addoption(
        "--mtcore-area",
        dest="mtcore_area",
        action="append",
        default=None,
        metavar="AREA",
        help="run only this area of the conformance kit: "
        f"{', '.join(_area_names())} (repeat the option, or separate by commas, for several; "
        "default: all)",
    )


def _area_names() -> list[str]:
    return [name for area in AREAS for name in (area, *_aliases_of(area))]


def _aliases_of(area: str) -> list[str]:
    return [alias for alias, target in AREA_ALIASES.items() if target == area]


def selected_areas(config: pytest.Config) -> tuple[str, ...]:
    """The areas ``--mtcore-area`` names, in summary order (all when it is not given).

    Raises ``pytest.UsageError`` for a name that is not an area.
    """
    raw = getattr(config.option, "mtcore_area", None) or []
    names = [n.strip() for value in raw for n in value.split(",") if n.strip()]
    if not names:
        return AREAS
    unknown = [n for n in names if AREA_ALIASES.get(n, n) not in AREAS]
    if unknown:
        raise pytest.UsageError(
            f"--mtcore-area {unknown[0]!r} is not an area of the mtcore conformance kit; "
            f"the areas are {', '.join(_area_names())}"
        )
    chosen = {AREA_ALIASES.get(n, n) for n in names}
    return tuple(area for area in AREAS if area in chosen)


def pytest_configure(config: pytest.Config) -> None:
    state = KitState(config)
    config.stash[_STATE] = state
    config.pluginmanager.register(state, "mtcore-conformance-state")


def kit_state(config: pytest.Config) -> KitState:
    return config.stash[_STATE]


def kit_backend(config: pytest.Config):
    """The backend under test, selected once per session (errors name the plugin)."""
    state = kit_state(config)
    if state.backend is None:
        from mtcore.backend import BackendError, select_backend

        try:
            state.backend = select_backend(state.requested)
        except BackendError as exc:  # a vendor debugging a plugin wants the frames too
            state.error = str(exc)
            details = f"\n{exc.tracebacks}" if exc.tracebacks else ""
            pytest.exit(
                f"mtcore conformance: {exc}{details}", returncode=pytest.ExitCode.USAGE_ERROR
            )
    return state.backend


def _summary(state: KitState, tr) -> None:
    name = getattr(state.backend, "name", None) or state.requested or "auto"
    tr.write_sep("=", f"mtcore conformance: backend {name}")
    if state.areas != AREAS:
        tr.write_line(f"areas: {', '.join(state.areas)} (--mtcore-area)")
    for area in state.areas:
        ids = [n for n, a in state.area_of.items() if a == area]
        counts = Counter(state.outcome.get(n, "not run") for n in ids)
        line = f"{area:<11} {counts['passed']:>4} passed  {counts['failed']:>3} failed  {counts['skipped']:>3} skipped"
        if counts["not run"]:
            line += f"  {counts['not run']:>3} not run"
        tr.write_line(
            line, red=bool(counts["failed"]), green=not counts["failed"] and bool(counts["passed"])
        )
    reasons = Counter(
        (state.area_of[n], state.skip_reason.get(n, ""))
        for n, o in state.outcome.items()
        if o == "skipped"
    )
    if reasons:
        tr.write_line("skipped:")
        for (area, reason), count in sorted(reasons.items()):
            tr.write_line(f"  {area}: {count} x {reason}")
    failed = [n for n, o in state.outcome.items() if o == "failed"]
    if failed:
        tr.write_line("failed:")
        for nodeid in failed:
            tr.write_line(f"  {state.area_of[nodeid]}: {nodeid.rsplit('::', 1)[-1]}", red=True)
    for area in state.areas:
        for line in state.notes.get(area, []):
            tr.write_line(f"{area}: {line}")
