import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# The scripts import their sibling common.py, as `python benchmarks/NAME.py` lets them.
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


@pytest.fixture
def run_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """``benchmarks/NAME.py --quick [ARGS]`` with its JSON and models under ``tmp_path``: (the process, the JSON path).

    The script runs in this process as ``python NAME.py`` would run it (``__main__``, its directory
    first on ``sys.path``, its arguments in ``sys.argv``): a subprocess would import torch and
    transformers again, ~7 CPU s quiet and twice that under load, for a run of a few CPU seconds.
    The torch thread count a script sets is put back afterwards."""
    def run(name: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
        out = tmp_path / f"{name}.json"
        argv = [str(BENCHMARKS / f"{name}.py"), "--quick", "--out", str(out), "--model-dir", str(tmp_path / "models"),
                *args]
        monkeypatch.setattr(sys, "argv", argv)
        threads = torch.get_num_threads()
        capsys.readouterr()
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1  # as the interpreter exits
        finally:
            torch.set_num_threads(threads)
        stdout, stderr = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, stdout, stderr), out
    return run
