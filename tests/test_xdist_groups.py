"""How `make test` splits the suite over xdist workers (tests/xdist_groups.py) and counts CPU
(tests/cpu_times.py)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests import xdist_groups
from tests.cpu_times import cpu_seconds


def item(nodeid: str, *fixtures: str, slow: bool = False) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, fixturenames=["request", *fixtures],
                           get_closest_marker=lambda name: slow if name == "slow" else None)


def test_files_sharing_a_session_server_are_one_unit_and_the_others_one_each():
    items = [
        item("tests/server/api/openai/test_api.py::test_a", "server", "embedded_server"),
        item("tests/server/api/openai/test_api.py::test_b", "server"),
        item("tests/server/api/openai/test_structured_api.py::test_c", "embedded_server"),
        item("tests/server/api/openai/test_fuzz.py::test_d", "short_tiny_server"),
        item("tests/server/api/anthropic/test_messages_fuzz.py::test_e", "short_tiny_server"),
        # two servers in one file join both their units
        item("tests/server/test_z.py::test_f", "short_tiny_server", "thinking_server"),
        item("tests/server/api/openai/test_reasoning_api.py::test_g", "thinking_server"),
        item("tests/engines/test_engine.py::test_h", "tiny_models"),
    ]
    assert xdist_groups.units(items) == {
        "tests/server/api/openai/test_api.py": "tests/server/api/openai/test_api.py",
        "tests/server/api/openai/test_structured_api.py": "tests/server/api/openai/test_api.py",
        "tests/server/api/openai/test_fuzz.py": "tests/server/api/anthropic/test_messages_fuzz.py",
        "tests/server/api/anthropic/test_messages_fuzz.py": "tests/server/api/anthropic/test_messages_fuzz.py",
        "tests/server/test_z.py": "tests/server/api/anthropic/test_messages_fuzz.py",
        "tests/server/api/openai/test_reasoning_api.py": "tests/server/api/anthropic/test_messages_fuzz.py",
        "tests/engines/test_engine.py": "tests/engines/test_engine.py",
    }


def test_units_with_a_slow_test_run_first_then_those_starting_a_server_then_the_largest():
    items = [
        item("tests/a.py::t1"), item("tests/a.py::t2"),
        item("tests/b.py::t1"), item("tests/b.py::t2"), item("tests/b.py::t3"),
        item("tests/c.py::t1"), item("tests/c.py::t2", slow=True),
        item("tests/d.py::t1", "server", "start_server"),
    ]
    xdist_groups.order(items, xdist_groups.units(items))
    assert [i.nodeid for i in items] == ["tests/c.py::t1", "tests/c.py::t2", "tests/d.py::t1", "tests/b.py::t1",
                                         "tests/b.py::t2", "tests/b.py::t3", "tests/a.py::t1", "tests/a.py::t2"]


def test_the_controller_schedules_the_units_the_workers_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr(xdist_groups, "units_file", lambda: tmp_path / "units.json")
    (tmp_path / "units.json").write_text(json.dumps({"tests/s.py": "tests/a.py", "tests/a.py": "tests/a.py"}))
    config = SimpleNamespace(getvalue={"tx": ["2*popen"]}.get)  # what `-n 2` leaves in the config
    scheduler = xdist_groups.UnitScheduling(config, log=None)
    assert scheduler._split_scope("tests/s.py::test_x[1]") == "tests/a.py"
    assert scheduler._split_scope("tests/a.py::test_y") == "tests/a.py"
    assert scheduler._split_scope("tests/new.py::test_z") == "tests/new.py"  # not in the file: its own unit


@pytest.mark.parametrize("reaped", [True, False])
def test_cpu_seconds_count_children_live_and_reaped(reaped):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\nprint(1, flush=True)\n"
    before = cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", burn + ("" if reaped else "input()")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "1\n"  # it has burnt its 0.2 s
    if reaped:
        child.wait()
        assert cpu_seconds() - before >= 0.2
    else:
        assert cpu_seconds() - before >= 0.2  # still running: counted through psutil
        child.communicate("\n")
