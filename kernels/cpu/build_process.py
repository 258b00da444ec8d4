"""Compiles the C++ kernels (kernels/cpu/cpp_build.py) in a child process that dies with its parent, and
takes ninja and the compilers with it.

torch's ``cpp_extension`` runs ninja, and ninja the compilers, as children of the process that calls
it. When that process ends mid-build (a worker leaves once its server is stopped by its PID, or is
SIGKILLed) they are re-parented to PID 1 and compile on for a minute or more in the build directory.
So the build runs in a child, ``python -m xinserve.kernels.cpu.build_process PARENT_PID``, that
- leads a process group of its own (``start_new_session``), which ninja and every compiler join;
- asks the kernel to send it SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``): the kernel
  does so however the parent ends, SIGKILL included, where an ``atexit`` hook, a ``finally`` or a
  signal handler of the parent's would not run; supervisors signal only the main PID, so the parent's
  own exit is the one event sure to happen;
- on that signal, sends SIGTERM to its group (itself excepted), every half second until it has left.
  Not SIGKILL: ninja runs each compile in a process group of its own, which a SIGKILL of ninja would
  orphan; on SIGTERM (as on a terminal's Ctrl-C) ninja passes the signal on to each of those groups and
  exits. torch then raises, its builder removes its ``lock`` file, and this process exits, releasing
  the flock of ``cpp_build._build_lock``. Were it SIGKILLed itself, the next builder removes the
  ``lock`` file it left, under that flock, so a killed build never blocks the next start.

PR_SET_PDEATHSIG fires when the parent *thread* that started the child ends (why
engines/parallel/tp_follower.py does not use it); here that thread waits for the child, so it cannot end first.
Where prctl is missing (not Linux), a thread polls ``getppid()`` instead.
"""

import ctypes
import ctypes.util
import importlib
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 0.5


def build_in_child(build: str) -> None:
    """Run ``build`` (``"module:function"``, e.g. ``cpp_build.load``) in a child tied to this process (see
    the module's docstring) and wait for it; ImportError with the child's reason when it fails. Named, not
    imported here, so that the builder may import this module."""
    done = subprocess.run([sys.executable, "-m", __name__, str(os.getpid()), build], check=False,
                          capture_output=True, text=True, start_new_session=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"the build process ended with status {done.returncode}"]
        raise ImportError(lines[-1])


_parent_gone = threading.Event()


def parent_gone() -> bool:
    """Whether the parent this process is tied to (``tie_to_parent``) has ended."""
    return _parent_gone.is_set()


def _end_build(*_) -> None:
    """Our parent is gone: stop the build (ninja, if it has started, stops its compilers)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _parent_gone.set()
    threading.Thread(target=_interrupt_group, name="end-build", daemon=True).start()


def _interrupt_group() -> None:
    """Repeated: ninja may start after the first signal (the main thread was about to run it)."""
    while True:
        os.killpg(os.getpgid(0), signal.SIGTERM)
        time.sleep(PARENT_POLL_S)


def tie_to_parent(parent: int) -> None:
    """End this process (and its process group) when ``parent`` ends (see the module's docstring)."""
    signal.signal(signal.SIGTERM, _end_build)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
    if libc is None or libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        threading.Thread(target=_poll_parent, args=(parent,), name="watch-parent", daemon=True).start()
    if os.getppid() != parent:  # it died before the tie was made: no signal will come
        _end_build()


def _poll_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    _end_build()


def main() -> None:
    tie_to_parent(int(sys.argv[1]))
    module, function = sys.argv[2].split(":")
    build = getattr(importlib.import_module(module), function)
    if _parent_gone.is_set():  # while torch was imported: build nothing
        sys.exit(1)
    try:
        build()
    except ImportError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
