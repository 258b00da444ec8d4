"""``pytest --cpu-report=PATH``: CPU seconds per test file and per shared (module/session) fixture.

Wall seconds on a shared machine are noise; CPU seconds are not. The CPU counted is this pytest
process's own (``time.process_time``), its reaped children's (``RUSAGE_CHILDREN``: servers and
subprocesses once they ended), and its live descendants' (psutil: a session-scoped server's HTTP and
worker processes, which end only with the session). A sample is taken when the next test belongs to
another file, and around each module/session fixture's set-up, so a shared server's start-up is
charged to its fixture and its later work to the files whose tests use it.

A descendant that leaves the tree without being reaped by it (an orphaned worker, re-parented to
init) takes its CPU seconds with it: the file during which it left can show less, even below zero.

Writes ``{"files": {file: cpu_s}, "fixtures": {name: cpu_s}, "total_cpu_s"}`` to PATH (under
pytest-xdist, one file per worker: ``PATH.gw0`` ...) and prints the 15 costliest files.
"""

import json
import resource
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import pytest


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and every descendant, live or reaped."""
    total = time.process_time()
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total += reaped.ru_utime + reaped.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # it ended between the listing and the read
            continue
        # a live child's own time plus the children it reaped (a server's restarted workers)
        total += t.user + t.system + t.children_user + t.children_system
    return total


class CpuTimes:
    """The plugin object registered by ``tests/conftest.py`` when ``--cpu-report`` is given."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: dict[str, float] = defaultdict(float)
        self.fixtures: dict[str, float] = defaultdict(float)
        self.start = cpu_seconds()
        self.mark = self.start
        self.current_file: str | None = None
        self.report: dict[str, Any] = {}

    def _charge(self, to: dict[str, float], name: str) -> None:
        now = cpu_seconds()
        to[name] += now - self.mark
        self.mark = now

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        self.current_file = item.nodeid.split("::")[0]
        yield
        # the file's share ends when the next test is in another file (its teardowns included)
        if nextitem is None or nextitem.nodeid.split("::")[0] != self.current_file:
            self._charge(self.files, self.current_file)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Any:
        shared = fixturedef.scope in ("module", "session", "package")
        if shared and self.current_file is not None:
            self._charge(self.files, self.current_file)  # what the file spent before this set-up
        yield
        if shared:
            self._charge(self.fixtures, f"{fixturedef.argname} ({fixturedef.scope})")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        worker = getattr(session.config, "workerinput", {}).get("workerid")
        path = self.path.with_name(f"{self.path.name}.{worker}") if worker else self.path
        if not worker:  # under xdist the controller runs no test: merge its workers' files
            for part in self.path.parent.glob(f"{self.path.name}.gw*"):
                done = json.loads(part.read_text())
                for key, into in (("files", self.files), ("fixtures", self.fixtures)):
                    for name, seconds in done[key].items():
                        into[name] += seconds
                part.unlink()
        # the controller's descendants are its workers: its total is the whole run's
        total = cpu_seconds() - self.start
        self.fixtures["(rest: imports, collection, workers' start)"] += (
            total - sum(self.files.values()) - sum(self.fixtures.values()))
        report = {
            "total_cpu_s": round(total, 1),
            "files": {k: round(v, 1) for k, v in sorted(self.files.items(), key=lambda kv: -kv[1])},
            "fixtures": {k: round(v, 1) for k, v in sorted(self.fixtures.items(), key=lambda kv: -kv[1])},
        }
        path.write_text(json.dumps(report, indent=1))
        self.report = report

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        report = self.report
        terminalreporter.section(f"CPU seconds: {report['total_cpu_s']} in all; costliest 15 files")
        for name, seconds in list(report["files"].items())[:15]:
            terminalreporter.write_line(f"{seconds:8.1f}  {name}")
