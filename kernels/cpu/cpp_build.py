"""Builds the C++ CPU kernels of ``kernels/cpu/cpp.py`` (``kernels/cpu/csrc/``), once per machine.

The install builds them (``python -m xinserve.kernels.cpu.cpp_build --install``: make's install step, the
Dockerfile) into the Python environment (``installed_dir``), where every server started from it finds
them, whatever its caches. A build made for other sources or another CPU is not used: the kernels then
build on first use (~30 s on 2 cores) into ``$TORCH_EXTENSIONS_DIR`` (default
``$XINSERVE_CACHE_DIR/torch_extensions``, so one cache volume carries it with the rest; set, it is the one
place looked in). Either build is keyed by the source, the torch version and the CPU's instruction-set
flags (it is compiled with ``-march=native``), so restarts and later workers load it at once; concurrent
builders wait on an ``flock`` (``_build_lock``). The compile runs in a child process
tied to the caller (kernels/cpu/build_process.py), so a build never outlives the process that wanted it.
``built()`` says whether a build is on disk already without building: the registry then lets an engine
start on the reference kernel and build in the background (kernels/registry.py, engines/worker/warmup.py).
"""

import fcntl
import hashlib
import importlib.util
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from xinserve.kernels.cache_dir import cache_dir
from xinserve.kernels.cpu.build_process import build_in_child

SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("paged_decode_attention.cpp", "write_kv.cpp", "decode_linear.cpp", "bindings.cpp")]
HEADERS = [Path(__file__).resolve().parent / "csrc" / "attention_math.h"]  # included by the sources; in the key
# Reassociation lets the compiler vectorise the float sums; contraction fuses a * b + c into one FMA
# (ISO C++ mode, -std=c++20, leaves it off).
# -fopenmp: at::parallel_for is a header template whose OpenMP pragma is compiled into this extension;
# without the flag every range runs on the calling thread, whatever torch.get_num_threads() says. The
# link flag resolves the OpenMP calls to the libgomp.so.1 torch has already loaded (same soname).
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-ffp-contract=fast", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def _cache_dir() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache_dir() / "torch_extensions")


def installed_dir() -> Path:
    """Where the install's build goes: inside the Python environment, so it comes with the install."""
    return Path(sys.prefix) / "share" / "xinserve" / "torch_extensions"


def cpu_flags() -> str:
    """The CPU's instruction-set flags (/proc/cpuinfo), which compiled code is specialised to."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build_key() -> str:
    """Names the build: the sources and headers, their paths, the compiler flags, the torch version and the CPU's
    instruction-set flags.
    The paths too, because ninja's build file names the sources by them: two checkouts sharing one
    build directory would rewrite that file and rebuild (half a minute each) on every load."""
    sources = "\n".join(f"{path.read_text()}\n{path}" for path in [*SOURCES, *HEADERS])
    text = f"{sources}\n{CFLAGS}\n{LDFLAGS}\n{torch.__version__}\n{cpu_flags()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Holds the build directory alone. torch's own lock is a plain file (``lock``) that a builder
    killed mid-build leaves behind, and every later load then waits on it forever. An ``flock`` is
    released by the kernel when its holder dies; while we hold it no builder of ours is running, so a
    ``lock`` file still there is stale and is removed."""
    with open(build_dir / "xinserve.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def build() -> ModuleType:
    """Build (or load the build of) the extension; ImportError when it cannot be built here. A build not
    on disk yet compiles in a child process that ends, compilers and all, when this one does
    (kernels/cpu/build_process.py); this process then loads what it built."""
    if not built():
        build_in_child(f"{__name__}:load")
    return load()


def load() -> ModuleType:
    """Compile (if not built yet) and load the extension in this process; ImportError when it cannot be
    built here. The install's build is imported as it is (its directory may be read-only to a server)."""
    from torch.utils import cpp_extension

    installed = _installed_library()
    if installed is not None:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, installed)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    build_dir = _build_dir(BUILD_KEY)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            return cpp_extension.load(
                name=MODULE_NAME,
                sources=[str(path) for path in SOURCES],
                extra_cflags=[*CFLAGS, f"-DXINSERVE_OPS={OPS_NAMESPACE}"],
                extra_ldflags=list(LDFLAGS),  # a copy: torch appends its own libraries to the list
                build_directory=str(build_dir),
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, no ninja, a failed build
        raise ImportError(f"cannot build the C++ CPU kernels: {str(exc).strip().splitlines()[-1]}") from None


BUILD_KEY = _build_key()
BUILDS_OPS = ("decode_attention", "write_kv", "linear")  # what kernels/cpu/cpp.py provides once built (kernels/registry.py)
MODULE_NAME = f"xinserve_paged_decode_{BUILD_KEY}"
OPS_NAMESPACE = f"xinserve_{BUILD_KEY}"  # its torch operators: torch.ops.<OPS_NAMESPACE>.write_kv, ...


def _build_dir(key: str) -> Path:
    return _cache_dir() / f"paged_decode_{key}"


def _installed_library() -> Path | None:
    """The install's build of these sources for this CPU, if there is one and ``$TORCH_EXTENSIONS_DIR``
    does not name the place to use."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return None
    library = installed_dir() / f"paged_decode_{BUILD_KEY}" / f"{MODULE_NAME}.so"
    return library if library.is_file() else None


def built() -> bool:
    """Whether this source's extension is on disk for this machine (loading it then takes a moment)."""
    return _installed_library() is not None or (_build_dir(BUILD_KEY) / f"{MODULE_NAME}.so").is_file()


if __name__ == "__main__":  # ``python -m xinserve.kernels.cpu.cpp_build [--install]``: build now
    # By its name: the build's child process imports ``xinserve.kernels.cpu.cpp_build:load``, not ``__main__``.
    from xinserve.kernels.cpu import cpp_build

    if "--install" in sys.argv[1:]:  # into the environment (make's install step, the Dockerfile)
        os.environ["TORCH_EXTENSIONS_DIR"] = str(installed_dir())
    try:
        cpp_build.build()
        print(f"C++ CPU kernels built in {_build_dir(BUILD_KEY)}")
    except ImportError as exc:  # no compiler here: the engines serve the reference kernels
        print(f"C++ CPU kernels not built ({exc}); the reference kernels serve")
