"""CPU kernels written in C++ (``kernels/csrc/``), built with ``torch.utils.cpp_extension`` on first
use: decode attention that reads the paged cache in place.

The build takes a minute or two and is cached under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/xinserve/torch_extensions``), keyed by the source, the torch version and the CPU's
instruction-set flags (it is compiled with ``-march=native``), so restarts and later workers load it
at once; concurrent builders wait on an ``flock`` (``_build_lock``). Without a C++ compiler (or
ninja) importing this module raises ImportError, and the registry keeps the reference.
"""

import fcntl
import hashlib
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kernels.model_shapes import ModelShapes

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_attention.cpp"


def _cache_dir() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "xinserve" / "torch_extensions")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build_key() -> str:
    """Names the build: the source, its path, the torch version and the CPU's instruction-set flags.
    The path too, because ninja's build file names the source by it: two checkouts sharing one
    build directory would rewrite that file and rebuild (half a minute each) on every load."""
    text = f"{SOURCE.read_text()}\n{SOURCE}\n{torch.__version__}\n{_cpu_flags()}"
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


def _build(key: str):
    from torch.utils import cpp_extension

    build_dir = _cache_dir() / f"paged_decode_{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            return cpp_extension.load(
                name=f"xinserve_paged_decode_{key}",
                sources=[str(SOURCE)],
                # Reassociation lets the compiler vectorise the dot products' float sums.
                extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fassociative-math",
                              "-fno-signed-zeros", "-fno-trapping-math"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, no ninja, a failed build
        raise ImportError(f"cannot build the C++ CPU kernels: {str(exc).strip().splitlines()[-1]}") from None


BUILD_KEY = _build_key()
_extension = _build(BUILD_KEY)


# Registered with torch.library so torch.compile (engines/graphs.py) can trace a decode forward that
# calls it: the fake implementation tells the compiler the output's shape without running the kernel.
@torch.library.custom_op(f"xinserve::paged_decode_attention_{BUILD_KEY}", mutates_args=())
def _paged_decode_op(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return _extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


@_paged_decode_op.register_fake
def _(query, key_cache, value_cache, block_tables, seq_lens, scale):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           gather: object = None) -> torch.Tensor:
    """The reference's signature; the gather plan is not needed (nothing is gathered). Eager calls
    skip the custom op's dispatch (tens of microseconds per layer); a traced one goes through it."""
    if not torch.compiler.is_compiling():
        return _extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return _paged_decode_op(query, key_cache, value_cache, block_tables, seq_lens, scale)


paged_decode_attention.build_key = BUILD_KEY  # a rebuilt kernel is timed again (kernels/timing.py)


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    if shapes.sliding_window is not None:
        return "sliding window unsupported"
    return None


OPS = {"paged_decode_attention": paged_decode_attention}
