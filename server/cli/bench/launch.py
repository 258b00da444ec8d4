"""Start, await and stop a server process for the benchmark scripts (``benchmarks/compare.py``,
``benchmarks/soak.py``): xinserve or a peer, each in a session of its own so that stopping it stops
its engine processes too."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``cmd`` in a new session, its output to ``log`` (a pipe nobody reads would fill and block it)."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen | None, log: Path | None = None,
               headers: dict[str, str] | None = None, timeout: float = 300.0) -> None:
    """Until ``/health`` and ``/v1/models`` answer 200 (xinserve and vLLM have both); raises when
    ``proc`` exits first or ``timeout`` passes, with the tail of ``log`` when given."""
    def tail() -> str:
        return f":\n{log.read_text(errors='replace')[-3000:]}" if log is not None else ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}{tail()}")
        try:
            if all(httpx.get(f"{url}{path}", headers=headers, timeout=5).status_code == 200
                   for path in ("/health", "/v1/models")):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {url} not ready after {timeout:.0f}s{tail()}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process's whole session (vLLM's engine is a child process), SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
