"""The LoRA decode-overhead benchmark runs end to end (--quick): a row per setup (off, on with base rows,
on with every row on an adapter) and batch, each with its ratio to LoRA off. No timing assertions: the
numbers depend on the machine."""

import json


def test_quick_run_reports_each_setup_and_batch_against_lora_off(run_quick) -> None:
    proc, out = run_quick("lora_overhead")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| LoRA | batch | forward ms / decode step | x off |" in proc.stdout
    result = json.loads(out.read_text())
    assert (result["rank"], result["max_loras"], result["steps"]) == (16, 4, 16)
    assert [(r["lora"], r["batch"]) for r in result["rows"]] == [
        (label, batch) for label in ("off", "on, base rows", "on, 4 adapters") for batch in (1, 8, 32)]
    assert all(r["forward_ms"] > 0 for r in result["rows"])
