"""benchmarks/compare.py on a small load with only xinserve installed: it benchmarks xinserve at each
concurrency, says which peers it skipped, and writes the markdown table, the plot and the JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"


@pytest.mark.slow
def test_compare_with_no_peers_installed(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--concurrency", "1,2", "--num-prompts", "4",
         "--output-tokens", "8", "--out-dir", str(out), "--peers-dir", str(tmp_path / "no-peers")],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped vLLM-CPU: no vllm environment" in proc.stdout
    table = (out / "compare.md").read_text()
    assert table.startswith("Machine: ")
    assert "| xinserve | c=1 | 100.0% |" in table and "| xinserve | c=2 | 100.0% |" in table
    assert "Skipped vLLM-CPU" in table
    result = json.loads((out / "xinserve.json").read_text())
    assert [r["successful"] for r in result["runs"]] == [4, 4]
    with Image.open(out / "compare.png") as image:
        assert image.size == (1100, 750)
