"""A bucket directory (engines/compile/spec.py): ``manifest.json`` says each finished bucket's outcome,
an artifact holds compiled code (``torch.compile(...).aot_compile``, saved whole: dynamo's guards and
bytecode with inductor's code; the C++ it compiled sits in inductor's cache, which the loader shares).

Buckets are compiled by unit (``units``): bucket 1 alone (``bucket-1.bin``: dynamo specialises a size of
1), every larger bucket together, one compile whose batch size is symbolic (``buckets-2-up.bin``: one
compile instead of one per bucket, and the same step speed, measured). Where the shared compile fails, its
buckets compile one by one (``bucket-<size>.bin``). ``lock-<unit>`` is held by the one process compiling
that unit, ``lock-manifest`` while the manifest is rewritten (sibling children and replicas sharing a
volume split the units; the later ones find them done).

Manifest entry per bucket: {"state": "compiled" | "eager" | "failed", "error": why eager or failed,
"compile_s", "eager_ms", "compiled_ms", "artifact": the file it runs}.
"""

import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

MANIFEST = "manifest.json"


SHARED = "buckets-2-up"  # the unit of every bucket above 1


def unit_of(size: int) -> str:
    return "bucket-1" if size == 1 else SHARED


def units(sizes) -> list[tuple[str, list[int]]]:
    """``sizes`` grouped by unit, the units in the order of their first bucket."""
    grouped: dict[str, list[int]] = {}
    for size in sizes:
        grouped.setdefault(unit_of(size), []).append(size)
    return list(grouped.items())


def artifact_path(directory: Path, name: str) -> Path:
    """The file of artifact ``name``: a unit (``bucket-1``, ``buckets-2-up``) or ``bucket-<size>``."""
    return directory / f"{name}.bin"


def read_manifest(directory: Path) -> dict[int, dict]:
    """bucket -> its entry; {} when nothing finished yet (or the manifest is unreadable)."""
    try:
        entries = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return {int(size): entry for size, entry in entries.items() if isinstance(entry, dict)}


def record(directory: Path, size: int, entry: dict) -> None:
    """Add one bucket's outcome; replaced whole, so a reader never sees half."""
    with lock(directory, "manifest"):
        entries = read_manifest(directory)
        entries[size] = entry
        text = json.dumps({str(s): e for s, e in sorted(entries.items())}, indent=1)
        with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as handle:
            handle.write(text)
        os.replace(handle.name, directory / MANIFEST)


@contextmanager
def lock(directory: Path, name: str) -> Iterator[None]:
    """Holds ``name`` in the directory alone (an ``flock``: released by the kernel when its holder dies)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"lock-{name}", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@contextmanager
def cpu_turn(directory: Path, exclusive: bool) -> Iterator[None]:
    """The cores among sibling compile children: compiles share them (``exclusive=False``), a timing run has
    them alone (``exclusive=True``: it waits for every sibling's compile to end, and a compile waits for it).
    Timed beside a sibling's compile, every run of a 0.3 ms step stalled to 40-50 ms (the worker's torch
    threads, which a bucket is compiled for, then outnumber the free cores), eager and compiled alike."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock-cpu", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


def save(compiled, directory: Path, name: str) -> None:
    compiled.save_compiled_function(str(artifact_path(directory, name)))


def trust_cpu_flags() -> None:
    """Inductor's vector instruction sets: those the CPU's flags name, without inductor's probe. The probe
    compiles and loads a test program per candidate set (10 compiler runs: 12-15 s on 2 cores, measured,
    in every process whose inductor cache is empty: the worker and each compile child). The compiler that
    would fail such a test is the one the C++ kernels were built with for ``-march=native``
    (kernels/cpu/cpp_build.py); a bucket inductor then cannot build fails alone and stays eager.
    ``TORCHINDUCTOR_VEC_ISA_OK`` set by the user still decides. Called by the compile child and the worker
    alike, so both generate and look up the same code."""
    from torch._inductor import config

    if os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is None:
        config.cpp.vec_isa_ok = True


def prepare_loading() -> None:
    """What the first ``load`` in a process would do besides loading, done now (before ready: a serving
    worker would otherwise pay it beside its steps): import dynamo and inductor (seconds of Python, the GIL
    held) and pick the CPU's vector instructions (``trust_cpu_flags``). Inductor compiles in this process
    from now on, never in a pool of its own: a loaded bucket's code is in the cache."""
    import torch._dynamo.aot_compile
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor import config, cpu_vec_isa

    config.compile_threads = 1
    trust_cpu_flags()
    cpu_vec_isa.valid_vec_isa_list()


def load(directory: Path, name: str) -> Callable:
    """The compiled bucket, called as ``decode_step`` is (engines/compile/decode_step.py). Costs tens of
    ms of Python (unpickling, the guards rebuilt, inductor's module loaded from its cache); the first
    load in a process also imports dynamo and inductor (seconds)."""
    import torch

    from xinserve.engines.compile import decode_step

    with open(artifact_path(directory, name), "rb") as handle:
        return torch.compiler.load_compiled_function(handle, f_globals=vars(decode_step))
