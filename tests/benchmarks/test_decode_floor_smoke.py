"""The decode-floor benchmark runs end to end (--quick, one small point, eager) and its floor counts the
bytes a step must read: the K/V of the batch's contexts in the cache's dtype, plus the weights. No timing
assertions: the numbers depend on the machine."""

import json

import pytest

# The 5M Llama: 4 layers, 2 KV heads of 64; float32 K and V per token = 2 * 4 * 2 * 64 * 4 bytes.
KV_BYTES_PER_TOKEN = 4096


def test_quick_run_reads_the_batch_contexts_kv_in_its_floor(run_quick) -> None:
    proc, out = run_quick("decode_floor", "--points", "2x32", "--threads", "1", "--modes", "eager")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| mode | threads | batch x context |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["kv_cache_dtype"] == "auto"
    (row,) = result["rows"]
    assert (row["mode"], row["threads"], row["batch"], row["context"]) == ("eager", 1, 2, 32)
    assert row["bytes"]["kv"] == 2 * 32 * KV_BYTES_PER_TOKEN
    assert row["bytes"]["total"] == row["bytes"]["weights"] + row["bytes"]["kv"] > row["bytes"]["kv"]
    assert row["step_ms"] > 0 and row["floor_ms"] > 0
    assert row["step_over_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
