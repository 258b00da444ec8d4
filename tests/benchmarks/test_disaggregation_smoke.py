"""The disaggregation benchmark runs end to end (--quick: three servers, the proxy, four requests; minutes on
a loaded machine) and reports both arms' TTFT / TPOT percentiles and the transfer's bytes, which are the long
prompts' KV blocks. No timing assertions: the numbers depend on the machine."""

import json

import pytest

pytestmark = pytest.mark.slow

# The 5M Llama: 4 layers, 2 KV heads of 64, float32 K and V: 4096 bytes per token; 16-token blocks.
KV_BYTES_PER_TOKEN = 4096


def test_quick_run_compares_both_arms_and_counts_the_transferred_blocks(run_quick) -> None:
    proc, out = run_quick("disaggregation")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| arm | requests | TTFT p50 ms |" in proc.stdout and "GB/s" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"single", "1p1d"}
    for arm in result["arms"].values():
        assert arm["requests"] == 4
        assert 0 < arm["ttft_ms"]["p50"] <= arm["ttft_ms"]["p99"]
        assert 0 < arm["tpot_ms"]["p50"] <= arm["tpot_ms"]["p99"]
    # Two long prompts of 128 tokens: every token but the last is read, in whole blocks (8 of 16 each).
    moved = result["transfer"]
    long_prompts = result["workload"]["requests"] // 2
    assert moved["bytes"] == long_prompts * 128 * KV_BYTES_PER_TOKEN
    assert moved["reads"] >= 1 and moved["gb_per_s"] > 0
