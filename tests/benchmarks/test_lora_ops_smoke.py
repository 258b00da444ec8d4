"""The LoRA-ops benchmark runs end to end (--quick: a tiny layer) with the reference ops: one row per decode
batch and the prefill, the overhead being the LoRA ops' time over the base linears'. No timing
assertions: the numbers depend on the machine."""

import json

import pytest


def test_quick_run_reports_the_lora_ops_against_the_base_linears(run_quick) -> None:
    proc, out = run_quick("lora_ops", "--prefill-tokens", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| phase | tokens | base linear ms |" in proc.stdout
    result = json.loads(out.read_text())
    assert (result["impl"], result["model"], result["max_lora_rank"], result["max_loras"]) == ("reference", "tiny", 16, 4)
    assert result["projections"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert [(r["phase"], r["tokens"]) for r in result["rows"]] == [
        ("decode", 1), ("decode", 8), ("decode", 32), ("prefill", 64)]
    for row in result["rows"]:
        assert row["base_linear_ms"] > 0 and row["lora_shrink_ms"] > 0 and row["lora_expand_ms"] > 0
        assert row["lora_ms"] == pytest.approx(row["lora_shrink_ms"] + row["lora_expand_ms"], abs=1e-3)
        assert row["overhead"] == pytest.approx(row["lora_ms"] / row["base_linear_ms"], rel=1e-2)
