"""The embeddings benchmark runs end to end (--quick: a server with --runner pooling, then ``xinserve
bench --endpoint embeddings`` at batch sizes 1 and 8) and writes well-formed results. No timing
assertions: the numbers depend on the machine."""

import json

import pytest


@pytest.mark.slow
def test_quick_run_writes_a_level_per_batch_size(run_quick) -> None:
    proc, out = run_quick("embeddings")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["batch_size"] for r in result["runs"]] == [1, 8]
    for run in result["runs"]:
        assert run["requests"] == 4 and run["failed"] == 0
        assert run["embeddings_per_s"] > 0 and run["prompt_tokens_per_s"] > 0
        assert run["latency_ms"]["p50"] > 0
