"""A bucket directory (engines/compile/spec.py): ``manifest.json`` says each finished bucket's outcome,
``bucket-<size>.bin`` holds a compiled bucket (``torch.compile(...).aot_compile``, saved whole: dynamo's
guards and bytecode with inductor's code; the C++ it compiled sits in inductor's cache, which the
loader shares). ``lock-bucket-<size>`` is held by the one process compiling that bucket, ``lock-manifest``
while the manifest is rewritten (sibling children and replicas sharing a volume split the buckets; the
later ones find them done).

Manifest entry per bucket: {"state": "compiled" | "eager" | "failed", "error": why eager or failed,
"compile_s", "eager_ms", "compiled_ms"}.
"""

import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

MANIFEST = "manifest.json"


def artifact_path(directory: Path, size: int) -> Path:
    return directory / f"bucket-{size}.bin"


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


def save(compiled, directory: Path, size: int) -> None:
    compiled.save_compiled_function(str(artifact_path(directory, size)))


def load(directory: Path, size: int) -> Callable:
    """The compiled bucket, called as ``decode_step`` is (engines/compile/decode_step.py). Costs tens of
    ms of Python (unpickling, the guards rebuilt, inductor's module loaded from its cache); the first
    load in a process also imports dynamo and inductor (seconds)."""
    import torch

    from xinserve.engines.compile import decode_step

    with open(artifact_path(directory, size), "rb") as handle:
        return torch.compiler.load_compiled_function(handle, f_globals=vars(decode_step))
