import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def run_quick(tmp_path: Path):
    """``benchmarks/NAME.py --quick`` with its JSON and models under ``tmp_path``: (the process, the JSON path)."""
    def run(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        out = tmp_path / f"{name}.json"
        proc = subprocess.run(
            [sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--out", str(out), "--model-dir",
             str(tmp_path / "models")],
            check=False, capture_output=True, text=True, timeout=600,
        )
        return proc, out
    return run
