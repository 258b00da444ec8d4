"""A C++ kernel build dies with the process that started it: no ninja or compiler runs on after it ends
(however it ends, SIGKILL included), and the next build is not blocked by what the killed one left."""

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from xinserve.kernels.cpu import cpp_build

# ninja and what it runs (the gcc driver, the compiler proper, the assembler, the linker)
COMPILERS = ("ninja", "cc1plus", "c++", "g++", "gcc", "cc", "as", "ld")


def working_in(directory: Path) -> list[psutil.Process]:
    """The live processes whose working directory is under ``directory`` (ninja and the compilers run in
    the build directory)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and Path(process.cwd()).is_relative_to(directory):
                found.append(process)
        except (psutil.Error, OSError):  # ended, or not ours to inspect
            continue
    return found


def flock_free(path: Path) -> bool:
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True  # closing the file releases it


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.slow
def test_a_build_dies_with_its_parent_and_leaves_nothing_that_blocks_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = cpp_build._build_dir(cpp_build.BUILD_KEY)
    parent = subprocess.Popen([sys.executable, "-c", "from xinserve.kernels.cpu.cpp_build import build; build()"],
                              env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        compiling = wait_for(lambda: [p for p in working_in(tmp_path) if p.name() in COMPILERS], 300,
                             "the build to start its compilers")
        assert not cpp_build.built()
        parent.kill()  # the hardest case: nothing of the parent's own runs
        parent.wait()
        wait_for(lambda: not working_in(tmp_path), 5, "the compilers to end with their parent")
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in compiling)
        # The killed build released torch's lock file and our flock: the next build is not blocked.
        wait_for(lambda: not (build_dir / "lock").exists(), 5, "torch's lock file to be removed")
        wait_for(lambda: flock_free(build_dir / "xinserve.lock"), 5, "the build's flock to be released")
    finally:
        parent.kill()
        for process in working_in(tmp_path):  # what the old code left running, so it does not run on
            process.send_signal(signal.SIGKILL)



INSTALLED_PROBE = """
import sys
from pathlib import Path
from xinserve.kernels.cpu import cpp_build
cpp_build.installed_dir = lambda: Path(sys.argv[1])
print(cpp_build.built())
if cpp_build.built():
    module = cpp_build.build()
    print(module.__file__, hasattr(module, "paged_decode_attention"))
"""


def test_the_installs_build_is_used_as_it_is_unless_torch_extensions_dir_names_another_place(tmp_path):
    """make's install step builds into the environment (``--install``): a server finds that build whatever
    its cache directory, imports it from a read-only directory without building anything, and ignores it
    when ``$TORCH_EXTENSIONS_DIR`` says where builds go."""
    cpp_build.build()  # the suite's own build (a no-op once built)
    installed = tmp_path / "installed" / f"paged_decode_{cpp_build.BUILD_KEY}"
    installed.mkdir(parents=True)
    library = installed / f"{cpp_build.MODULE_NAME}.so"
    library.write_bytes((cpp_build._build_dir(cpp_build.BUILD_KEY) / library.name).read_bytes())
    installed.chmod(0o555)
    env = {key: value for key, value in os.environ.items() if key != "TORCH_EXTENSIONS_DIR"}
    env["XINSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    try:
        found = subprocess.run([sys.executable, "-c", INSTALLED_PROBE, str(tmp_path / "installed")], env=env,
                               capture_output=True, text=True, check=True).stdout.split()
        assert found == ["True", str(library), "True"]
        assert not (tmp_path / "cache").exists()  # nothing built, nothing written
        elsewhere = {**env, "TORCH_EXTENSIONS_DIR": str(tmp_path / "elsewhere")}
        found = subprocess.run([sys.executable, "-c", INSTALLED_PROBE, str(tmp_path / "installed")], env=elsewhere,
                               capture_output=True, text=True, check=True).stdout.split()
        assert found == ["False"]
    finally:
        installed.chmod(0o755)
