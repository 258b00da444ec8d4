"""The compile child's decisions (engines/compile/child.py), the artifact key (engines/compile/spec.py) and
the bucket directory (engines/compile/artifacts.py), in process with a stand-in for torch.compile; the real
compile in a child is covered by tests/engines/worker/test_decode_graphs.py."""

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from xinserve.engines.compile import artifacts, child
from xinserve.engines.compile.spec import CompileSpec
from xinserve.engines.config import EngineConfig


class FakeCompiled:
    """What ``aot_compile`` returns: callable, saveable."""

    def __init__(self, function) -> None:
        self.function, self.saved = function, []

    def __call__(self, *args):
        return self.function(*args)

    def disable_guard_check(self) -> None:
        pass

    def save_compiled_function(self, path: str) -> None:
        Path(path).write_bytes(b"artifact")
        self.saved.append(path)


def fake_compile(behaviour: str, calls: list | None = None):
    """torch.compile standing in: ``behaviour`` "raise" fails every compile, "raise dynamic" those with a
    symbolic batch; ``calls`` gets each compile's options."""
    class Compiled:
        def __init__(self, function, **options) -> None:
            self.function, self.options = function, options

        def aot_compile(self, example):
            if calls is not None:
                calls.append(self.options)
            if behaviour == "raise" or (behaviour == "raise dynamic" and self.options["dynamic"]):
                raise RuntimeError("inductor: C++ compile error\nmore lines")
            return FakeCompiled(self.function)

    return Compiled


class Buffers:
    """The step buffers standing in: no inputs; records the buckets padded."""

    def __init__(self) -> None:
        self.padded = []

    def inputs(self, size):
        return ()

    def pad(self, size):
        self.padded.append(size)


def spec(tmp_path: Path, mode: str = "auto", **changes) -> CompileSpec:
    (tmp_path / "config.json").write_text("{}")
    config = EngineConfig(model=str(tmp_path), **changes)
    return CompileSpec(config, 16, (2,), 64, (1, 2), (1, 2), mode, False, 1, True)


@pytest.mark.parametrize(("mode", "timings", "state"), [
    ("auto", [2.0, 1.0], "compiled"),  # (eager ms, compiled ms)
    ("auto", [1.0, 1.5], "eager"),
    ("auto", [39.99, 40.0], "compiled"),  # a tie (both stalled beside a sibling's compile) is no reason for eager
    ("auto", [1.0, 1.09], "compiled"),
    ("on", [1.0, 1.5], "compiled"),
])
def test_a_bucket_is_kept_compiled_where_it_measures_faster_or_mode_on(tmp_path, monkeypatch, mode, timings, state):
    monkeypatch.setattr(child.torch, "compile", fake_compile("ok"))
    monkeypatch.setattr(child, "timings", lambda compiled, args: (timings.pop(0), timings.pop(0)))
    entry = child.compile_static(spec(tmp_path, mode), tmp_path, torch.nn.Identity(), torch.zeros(1), Buffers(), 2)
    assert entry["state"] == state and entry["compile_s"] >= 0
    assert artifacts.artifact_path(tmp_path, "bucket-2").exists() == (state == "compiled")
    assert entry["error"] == ("eager measured faster" if state == "eager" else None)
    assert entry.get("artifact") == ("bucket-2" if state == "compiled" else None)


def test_a_compile_that_raises_is_a_failed_bucket_with_the_first_line(tmp_path, monkeypatch):
    monkeypatch.setattr(child.torch, "compile", fake_compile("raise"))
    entry = child.compile_static(spec(tmp_path), tmp_path, torch.nn.Identity(), torch.zeros(1), Buffers(), 1)
    assert entry == {"state": "failed", "error": "RuntimeError: inductor: C++ compile error"}
    assert not artifacts.artifact_path(tmp_path, "bucket-1").exists()


def test_bucket_1_is_a_unit_alone_and_the_larger_buckets_one_unit():
    assert artifacts.units([8, 1, 2, 64]) == [("buckets-2-up", [8, 2, 64]), ("bucket-1", [1])]
    assert artifacts.units([1]) == [("bucket-1", [1])]
    assert artifacts.units([]) == []


def test_the_larger_buckets_compile_once_with_a_symbolic_batch_and_share_one_artifact(tmp_path, monkeypatch):
    calls, timings = [], [2.0, 1.0, 1.0, 1.5, 2.0, 1.0]  # (eager, compiled) per bucket: 4 measures eager faster
    monkeypatch.setattr(child.torch, "compile", fake_compile("ok", calls))
    monkeypatch.setattr(child, "timings", lambda compiled, args: (timings.pop(0), timings.pop(0)))
    buffers = Buffers()
    entries = child.compile_unit(spec(tmp_path), tmp_path, torch.nn.Identity(), torch.zeros(1), buffers,
                                 "buckets-2-up", [2, 4, 8])
    assert [c["dynamic"] for c in calls] == [True]  # one compile for the three
    assert buffers.padded[0] == 4  # traced at the median bucket
    assert {size: e["state"] for size, e in entries.items()} == {2: "compiled", 4: "eager", 8: "compiled"}
    assert entries[2]["artifact"] == entries[8]["artifact"] == "buckets-2-up" and "artifact" not in entries[4]
    assert artifacts.artifact_path(tmp_path, "buckets-2-up").exists()
    assert not any(artifacts.artifact_path(tmp_path, f"bucket-{size}").exists() for size in (2, 4, 8))


def test_timing_takes_the_fastest_of_runs_in_turns(monkeypatch):
    calls = []

    def step(name, delays):
        def run(*args):
            calls.append(name)
            time.sleep(delays.pop(0) if delays else 0.001)
        return run

    # The compiled step's early runs stall (a sibling's compiler had the core); its fastest run counts.
    monkeypatch.setattr(child, "decode_step", step("eager", []))
    eager_ms, compiled_ms = child.timings(step("compiled", [0.05] * 5), ())
    assert calls[:4] == ["eager", "compiled", "eager", "compiled"]
    assert len(calls) == 2 * (child.TIMING_ITERATIONS + 1)
    assert 1.0 <= eager_ms < 10 and 1.0 <= compiled_ms < 10


def test_a_shared_compile_that_fails_compiles_each_bucket_alone(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(child.torch, "compile", fake_compile("raise dynamic", calls))
    monkeypatch.setattr(child, "timings", lambda compiled, args: (1.0, 0.5))
    entries = child.compile_unit(spec(tmp_path), tmp_path, torch.nn.Identity(), torch.zeros(1), Buffers(),
                                 "buckets-2-up", [2, 4])
    assert [c["dynamic"] for c in calls] == [True, False, False]
    assert {size: (e["state"], e["artifact"]) for size, e in entries.items()} == {
        2: ("compiled", "bucket-2"), 4: ("compiled", "bucket-4")}
    assert not artifacts.artifact_path(tmp_path, "buckets-2-up").exists()


def test_the_key_ignores_serving_settings_and_follows_what_shapes_the_step(tmp_path):
    base = spec(tmp_path)
    same = [dataclasses.replace(base, config=dataclasses.replace(base.config, **change)) for change in (
        {"seed": 7}, {"async_scheduling": False}, {"max_cpu_threads": 4}, {"ready_when_warm": True},
        {"tokenizer": "elsewhere"}, {"data_parallel_rank": 3})]
    assert {s.key() for s in same} == {base.key()}
    assert dataclasses.replace(base, order=(2,), low_priority=False, threads=2).key() == base.key()
    other = [dataclasses.replace(base, config=dataclasses.replace(base.config, **change)) for change in (
        {"dtype": "bfloat16"}, {"block_size": 32}, {"num_kv_blocks": 99}, {"kernels": {"linear": "cpp"}},
        {"max_model_len": 128}, {"enable_lora": True})]
    other += [dataclasses.replace(base, sizes=(1, 2, 4)),
              dataclasses.replace(base, mode="on")]
    assert len({s.key() for s in other} | {base.key()}) == len(other) + 1
    before = base.key()
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')  # another architecture at the same path
    assert base.key() != before


def test_the_manifest_is_replaced_whole_and_the_lock_is_exclusive(tmp_path):
    artifacts.record(tmp_path, 4, {"state": "compiled", "error": None})
    artifacts.record(tmp_path, 1, {"state": "eager", "error": "eager measured faster"})
    assert artifacts.read_manifest(tmp_path) == {1: {"state": "eager", "error": "eager measured faster"},
                                                 4: {"state": "compiled", "error": None}}
    assert json.loads((tmp_path / artifacts.MANIFEST).read_text())["4"]["state"] == "compiled"
    assert artifacts.read_manifest(tmp_path / "missing") == {}
    (tmp_path / artifacts.MANIFEST).write_text("{half")  # unreadable: nothing is taken as done
    assert artifacts.read_manifest(tmp_path) == {}
    holder = "import sys, time\nfrom xinserve.engines.compile import artifacts\nfrom pathlib import Path\n" \
             "with artifacts.lock(Path(sys.argv[1]), 'bucket-4'):\n    print('held', flush=True)\n    time.sleep(1.5)\n"
    other = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline().strip() == "held"
    start = time.monotonic()
    with artifacts.lock(tmp_path, "bucket-2"):  # another bucket: no wait
        assert time.monotonic() - start < 0.5
    with artifacts.lock(tmp_path, "bucket-4"):  # waits for the other process's turn
        waited = time.monotonic() - start
    other.wait()
    assert waited > 0.5


def test_the_child_lowers_its_priority(monkeypatch):
    calls = []
    monkeypatch.setattr(child.os, "sched_setscheduler", lambda pid, policy, param: calls.append(policy))
    assert child.lower_priority() == "SCHED_IDLE" and calls == [child.os.SCHED_IDLE]

    def refused(*args):
        raise PermissionError("not allowed")

    monkeypatch.setattr(child.os, "sched_setscheduler", refused)
    monkeypatch.setattr(child.os, "nice", lambda increment: calls.append(increment))
    assert child.lower_priority() == "nice 19" and calls[-1] == 19


def test_a_timing_waits_for_a_siblings_compile_and_compiles_share_the_cores(tmp_path):
    holder = "import sys, time\nfrom xinserve.engines.compile import artifacts\nfrom pathlib import Path\n" \
             "with artifacts.cpu_turn(Path(sys.argv[1]), exclusive=False):\n    print('compiling', flush=True)\n" \
             "    time.sleep(1.5)\n"
    sibling = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert sibling.stdout.readline().strip() == "compiling"
    start = time.monotonic()
    with artifacts.cpu_turn(tmp_path, exclusive=False):  # another compile: side by side, no wait
        assert time.monotonic() - start < 0.5
    with artifacts.cpu_turn(tmp_path, exclusive=True):  # a timing: once the sibling's compile is over
        waited = time.monotonic() - start
    sibling.wait()
    assert waited > 0.5
