"""The worker's side of a compile child (engines/compile/child.py): start it, read its events, stop it."""

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from xinserve.engines.compile.spec import CompileSpec


class CompileChild:
    """One child compiling ``spec``'s buckets; ``events()`` yields its JSON events until it exits."""

    def __init__(self, spec: CompileSpec, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=directory, prefix="spec-", suffix=".pickle", delete=False) as handle:
            pickle.dump((spec, directory), handle)  # the directory named once: the worker reads from where it writes
        self._spec_path = Path(handle.name)
        # stderr (its log) to a file: a pipe nobody reads while we wait on stdout could fill and stall it.
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115  closed by finish()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xinserve.engines.compile.child", str(os.getpid()), str(self._spec_path)],
            stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True)

    def events(self) -> Iterator[dict]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                yield json.loads(line)

    def finish(self) -> str | None:
        """Wait for the exit; None when it succeeded, else its last log line."""
        code = self.process.wait()
        self._spec_path.unlink(missing_ok=True)
        self._log.seek(0)
        lines = [line for line in self._log.read().strip().splitlines() if line.strip()]
        self._log.close()
        if code == 0:
            return None
        return (lines[-1] if lines else f"the compile process ended with status {code}")[:300]

    def stop(self) -> None:
        """End it and its process group (the compilers it started) at once: the engine is closing."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:  # gone meanwhile
                pass
