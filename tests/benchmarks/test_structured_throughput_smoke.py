"""The structured-output throughput benchmark runs end to end (--quick) and writes well-formed results.
No timing assertions: the numbers depend on the machine."""

import json


def test_quick_run_writes_both_modes(run_quick) -> None:
    proc, out = run_quick("structured_throughput")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| mode | unconstrained tok/s |" in proc.stdout
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["rows"]] == ["greedy", "sampled"]
    for row in result["rows"]:
        assert row["unconstrained_tok_s"] > 0 and row["json_schema_tok_s"] > 0
        assert row["ratio"] == row["json_schema_tok_s"] / row["unconstrained_tok_s"]
