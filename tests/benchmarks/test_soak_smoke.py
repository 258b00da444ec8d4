"""The soak benchmark runs end to end on a small load (--start on the tiny model) and the server
comes out of it clean: no 5xx, every malformed request refused with a 4xx, nothing left running
or waiting. No timing assertions: the numbers depend on the machine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.mark.slow
def test_small_soak_leaves_the_server_idle(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--start", "--model", str(tiny_model_dir), "--requests", "40",
         "--concurrency", "8", "--max-tokens", "8", "--out", str(out), "--server-log", str(tmp_path / "server.log")],
        check=False, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| requests | concurrency | success rate |" in proc.stdout
    result = json.loads(out.read_text())
    r = result["results"]
    assert r["requests"] == 40
    assert r["status_5xx"] == 0 and r["transport_errors"] == 0 and r["error_frames"] == 0
    assert (r["disconnects"], r["malformed_refused_4xx"]) == (4, 2)  # 10% dropped, 5% malformed
    assert r["ok"] == r["normal"] == 34 and r["success_rate"] == 1.0
    after = result["after"]
    assert after["idle"]
    for name in ("xinserve:num_requests_running", "xinserve:num_requests_waiting"):
        assert set(after["gauges"][name].values()) == {0.0}, name
    assert after["health_status"] == "ok"
    memory = after["memory"]
    assert {"server", f"worker {tiny_model_dir.name}/cpu"} <= memory.keys()
    assert all(m["rss_mib"] > 0 for m in memory.values())
