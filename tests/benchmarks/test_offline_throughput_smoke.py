"""The offline throughput benchmark runs end to end (--quick) and writes well-formed results.
No timing assertions: the numbers depend on the machine."""

import json

ROW_NUMBERS = ("engine_tok_s", "hf_tok_s", "speedup", "engine_step_ms", "engine_forward_ms", "engine_steps")


def test_quick_run_writes_every_result(run_quick) -> None:
    proc, out = run_quick("offline_throughput")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| workload | batch |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["model"]["parameters"] > 0
    assert result["dtype"] in ("float32", "bfloat16")
    assert result["threads"] >= 1
    assert {"amx_bf16", "avx512_bf16", "name"} <= result["cpu"].keys()
    rows = result["rows"]
    assert [(r["workload"], r["batch"]) for r in rows] == [("equal", 1), ("equal", 8), ("mixed", 8)]
    for row in rows:
        for key in ROW_NUMBERS:
            assert row[key] > 0, (row["workload"], row["batch"], key)
        assert 0 <= row["engine_overhead_ms"] < row["engine_step_ms"]  # the forward runs inside the step
    workload = result["workload"]
    low, high = workload["mixed_range"]
    for row in rows:
        if row["workload"] == "equal":
            assert row["output_tokens"] == row["requests"] * workload["max_tokens"]
        else:
            assert row["requests"] * low <= row["output_tokens"] <= row["requests"] * high
