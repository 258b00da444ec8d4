"""``python -m xinserve.server.cli.bytecode``: byte-compiles, once at install, the Python a server start
runs (make's install step does; ``pip install`` without ``--no-compile`` does it for everything).

Why: an install made with ``pip install --no-compile`` (the Makefile's: byte-compiling all ~250 MB of
installed Python costs ~80 CPU s) leaves Python to compile each module on first import and keep the
bytecode in ``__pycache__`` -- unless ``PYTHONDONTWRITEBYTECODE`` is set (many machines and images set
it): then every process compiles from source again. A server start is several processes (the server,
its workers, the compile children of engines/compile/), each importing torch, transformers and, for the
decode buckets, dynamo and inductor: ~12 s of compiling per process (measured: 3,165 modules). Here
they are compiled once, into the ``__pycache__`` beside each source, where every later import reads
them whatever the environment says.

What: every module loaded after importing what the serving processes import (``IMPORTS``), plus the whole
of the packages torch.compile imports lazily while it compiles (``PACKAGES``).
"""

import compileall
import importlib
import os
import py_compile
import sys
import time
from pathlib import Path

# What the server, a worker and a compile child import before they serve or compile.
IMPORTS = (
    "xinserve.server.cli.main",
    "xinserve.server.app",
    "xinserve.server.worker.engine_worker",
    "xinserve.engines.core.engine",
    "xinserve.engines.compile.child",
    "xinserve.engines.compile.artifacts",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "transformers",
)
# Packages whose modules torch.compile imports one by one as it traces and generates code: all of them.
PACKAGES = ("torch._inductor", "torch._dynamo", "torch._functorch", "torch.fx", "torch._subclasses",
            "torch._higher_order_ops", "torch._prims", "torch._refs", "torch._decomp", "torch.export", "sympy")


def loaded_sources() -> set[Path]:
    """The ``.py`` file of every module imported so far."""
    sources = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and path.endswith(".py"):
            sources.add(Path(path))
    return sources


def package_dir(name: str) -> Path | None:
    try:
        module = importlib.import_module(name)
    except ImportError:  # an optional package not installed: nothing of it runs
        return None
    return Path(module.__file__).parent


def compile_all(workers: int = 0) -> int:
    """Byte-compile ``IMPORTS``' modules and ``PACKAGES``; returns the number of modules it covered."""
    for name in IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional part (the compile child without inductor, say)
            continue
    dirs = [d for d in (package_dir(name) for name in PACKAGES) if d is not None]
    for directory in dirs:
        compileall.compile_dir(directory, quiet=2, workers=workers)
    singles = [path for path in loaded_sources() if not any(path.is_relative_to(d) for d in dirs)]
    for path in singles:
        try:
            py_compile.compile(str(path), doraise=True)
        except (py_compile.PyCompileError, OSError):  # unwritable or not valid here: imported from source
            continue
    return len(singles) + sum(1 for d in dirs for _ in d.rglob("*.py"))


def main() -> int:
    start = time.perf_counter()
    count = compile_all(workers=len(os.sched_getaffinity(0)))
    print(f"byte-compiled {count} modules a server start imports in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
