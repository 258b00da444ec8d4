"""A config none of whose workers can start ends `xinserve serve` with their errors; one worker
whose device fails leaves the others serving, with the device's own error on /health."""

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xinserve.server.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args],
        check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.slow
def test_every_worker_failing_exits_non_zero_with_the_device_error(tiny_model_dir):
    start = time.monotonic()
    done = serve("--model", str(tiny_model_dir), "--device", "npu:0")
    assert done.returncode == 1
    assert time.monotonic() - start < 60
    err = done.stderr
    assert "xinserve: no worker of any model could start:" in err
    assert "npu:0" in err and "torch_npu is not installed" in err and "CANN" in err
    assert "Traceback" not in err.split("xinserve: no worker")[1]


def test_a_missing_model_directory_exits_non_zero():
    done = serve("--model", "/nonexistent/model-dir")
    assert done.returncode == 1 and "/nonexistent/model-dir does not exist" in done.stderr


@pytest.mark.slow
def test_one_failed_device_leaves_the_others_serving(start_server, tiny_model_dir):
    srv = start_server(["--model", str(tiny_model_dir), "--device", "cpu", "--device", "musa:0",
                        "--served-model-name", "tiny"])
    health = srv.wait_settled(timeout=120)
    states = {w["worker"]: (w["state"], w["last_error"]) for w in health["workers"]}
    assert states["cpu"][0] == "ready"
    assert states["musa:0"][0] == "failed" and "torch_musa is not installed" in states["musa:0"][1]
    assert health["status"] == "degraded"
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    srv.stop()


@pytest.mark.slow
def test_a_tokenizer_that_cannot_load_ends_with_its_error_alone(stories_dir, tmp_path):
    """The model's workers are closed when its tokenizer fails, and again at shutdown: the second close
    once raised ZMQError (``Socket operation on non-socket``) after the error line."""
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    done = serve("--model", str(stories_dir), "--tokenizer", str(tmp_path))
    assert done.returncode == 1
    assert "xinserve: no worker of any model could start:" in done.stderr
    assert "cannot load the tokenizer of stories260K" in done.stderr
    assert "Traceback" not in done.stderr and "ZMQError" not in done.stderr
