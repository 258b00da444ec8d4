"""How ``make test`` spreads the suite over pytest-xdist workers (``-n 2 --dist loadfile``).

A test file is one unit of work, so its module-scoped server starts once. Files that share a
session-scoped server (``SHARED_SERVERS``) are one unit too, so that server starts on one worker,
not on each. Units holding a ``slow`` test go first, then those that start a server, then the others
by size: the last unit to run is a short one, and the two workers end close together.

The units are computed where the tests are collected (each worker, from the tests' fixtures and
marks) and read where they are scheduled (the controller, which collects nothing): each worker
writes ``{file: unit}`` to the file named in its ``workerinput``. (xdist's own ``xdist_group``
mark cannot carry them: it renames node ids, which pytest 9 no longer lets a plugin do.)
"""

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

# Session-scoped fixtures that start a server (tests/server/conftest.py); a file that uses one
# joins that server's unit.
SHARED_SERVERS = frozenset({"assorted_server", "embedded_server", "keyed_server", "short_tiny_server",
                            "thinking_server"})
UNITS_KEY = "xinserve_units_file"  # the workerinput entry naming the file


def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def units(items: Iterable[pytest.Item]) -> dict[str, str]:
    """``{test file: its unit's name}``; a unit is named after its first file (sorted), so every
    worker, collecting the same items, names it the same."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    def join(a: str, b: str) -> None:
        a, b = root(a), root(b)
        parent[max(a, b)] = min(a, b)

    files = []
    for item in items:
        files.append(file_of(item.nodeid))
        for server in SHARED_SERVERS.intersection(item.fixturenames):
            join(file_of(item.nodeid), f"~{server}")  # "~" sorts after every path: a file names the unit
    return {file: root(file) for file in files}


def order(items: list[pytest.Item], unit_of: dict[str, str]) -> None:
    """Units with a ``slow`` test first, then those that start a server (~20 s each, however few
    their tests), then by number of tests (in place; a unit's tests keep their order)."""
    size: dict[str, int] = {}
    slow: set[str] = set()
    serving: set[str] = set()
    for item in items:
        unit = unit_of[file_of(item.nodeid)]
        size[unit] = size.get(unit, 0) + 1
        if item.get_closest_marker("slow"):
            slow.add(unit)
        if "start_server" in item.fixturenames:  # fixturenames is the closure: a server fixture's too
            serving.add(unit)

    def key(item: pytest.Item) -> tuple[bool, bool, int]:
        unit = unit_of[file_of(item.nodeid)]
        return unit not in slow, unit not in serving, -size[unit]

    items.sort(key=key)


def units_file() -> Path:
    """Where this run's workers write the units: named after the controller's pid."""
    return Path(tempfile.gettempdir()) / f"xinserve-xdist-units-{os.getpid()}.json"


def on_worker_collected(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker: order the tests and publish the units to the controller."""
    unit_of = units(items)
    order(items, unit_of)
    path = Path(config.workerinput[UNITS_KEY])
    partial = path.with_name(f"{path.name}.{config.workerinput['workerid']}")
    partial.write_text(json.dumps(unit_of))
    partial.replace(path)  # both workers write the same content; a reader sees one whole file


class UnitScheduling(LoadScopeScheduling):
    """xdist's ``loadfile``, with a unit (``units``) in place of a file."""

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)
        self._units: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:  # first called once every worker has collected (and written)
            path = units_file()
            self._units = json.loads(path.read_text()) if path.exists() else {}
            path.unlink(missing_ok=True)
        return self._units.get(file_of(nodeid), file_of(nodeid))
