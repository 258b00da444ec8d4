"""The loop-thread CPU benchmark runs end to end (--quick) on steady async decode steps and writes every
phase. No timing assertions: the numbers depend on the machine."""

import json

PHASES = ("schedule", "prepare", "pending_rows", "commit", "resolve", "kv_events", "forget", "can_overlap", "emit",
          "other", "total")


def test_quick_run_measures_every_phase_of_steady_steps(run_quick) -> None:
    proc, out = run_quick("loop_thread_cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| phase | this |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["batch"] == 8
    (run,) = result["arms"]["this"]["runs"]
    # 24 outputs: a prefill step, then decode steps; the last ones shrink the batch as requests finish.
    assert 16 <= run["steady_steps"] <= 23
    phases = result["summary"]["this"]["phases_us"]
    assert set(phases) == set(PHASES)
    assert all(phases[k] >= 0 for k in PHASES if k != "other")
    assert phases["total"] >= phases["schedule"] + phases["prepare"] > 0
    assert result["summary"]["this"]["python_calls_per_step"] > 0
