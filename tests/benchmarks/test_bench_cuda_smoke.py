"""The device script (tests/gpu/bench_cuda.py) runs end to end on the CPU with tiny shapes (--cpu-smoke) and
writes one well-formed JSON: every section's figures, or its skip with the reason. No timing assertions:
on the CPU the numbers mean nothing; on a GPU lease the same code measures."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "gpu" / "bench_cuda.py"


def run(tmp_path: Path, sections: str) -> tuple[int, dict]:
    spec = importlib.util.spec_from_file_location("bench_cuda", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "cuda_bench.json"
    threads = torch.get_num_threads()
    try:
        code = module.main(["--cpu-smoke", "--out", str(out), "--model-dir", str(tmp_path / "models"),
                            "--sections", sections])
    finally:
        torch.set_num_threads(threads)
    return code, json.loads(out.read_text())


def positive(value) -> bool:
    return isinstance(value, float | int) and value > 0 and math.isfinite(value)


def test_every_offline_section_runs_and_writes_its_figures(tmp_path: Path) -> None:
    code, result = run(tmp_path, "matmul_floor,offline_1b,buckets,host_phases,async")
    sections = result["sections"]
    assert code == 0, {name: s.get("error") for name, s in sections.items()}
    assert result["plan"]["batches"] == [1, 2] and "cpu" in result["environment"]["device"]
    assert [(r["shape"], r["batch"]) for r in sections["matmul_floor"]["rows"]] == [("tiny", 1), ("tiny", 2)]
    assert all(positive(r["floor_ms"]) for r in sections["matmul_floor"]["rows"])
    for row in sections["offline_1b"]["rows"]:
        assert positive(row["step_ms"]) and row["step_over_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
    buckets = sections["buckets"]
    assert [(r["bucket"], r["batch"]) for r in buckets["rows"]] == [(1, 1), (2, 2)]
    assert all(positive(r["graphs_ms"]) and positive(r["eager_ms"]) for r in buckets["rows"])
    assert buckets["captured"] is False and buckets["replays"] == []  # the CPU captures nothing
    phases = sections["host_phases"]["rows"]
    assert [r["batch"] for r in phases] == [1, 2]
    for row in phases:
        assert all(row[k] >= 0 for k in ("schedule", "inputs", "launch", "device", "sample", "update", "output"))
        assert row["step"] >= row["launch"] + row["sample"] and row["host_ms"] == pytest.approx(row["step"] - row["device"])
    rows = sections["async"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(positive(r["async_ms"]) and positive(r["sync_ms"]) for r in rows)
    assert sections["async"]["recommendation"] in ("async_scheduling_on_accelerators: true",
                                                   "async_scheduling_on_accelerators: false")
    assert sections["server"] == {"status": "skipped", "reason": "not chosen (--sections)"}
    assert sections["offline_8b"]["status"] == "skipped"  # the smoke plan has one shape


@pytest.mark.slow
def test_the_server_section_serves_every_concurrency(tmp_path: Path) -> None:
    code, result = run(tmp_path, "offline_1b,server")
    server = result["sections"]["server"]
    assert code == 0 and server["status"] == "ran", server
    assert [r["concurrency"] for r in server["rows"]] == [1, 2]
    for row in server["rows"]:
        assert row["failed"] == 0 and positive(row["output_tok_s"]) and positive(row["tpot_ms"]["mean"])
    assert positive(server["tpot_c1_over_offline_step"])
