"""A model directory built once into a cache and reused after: ``ensure_built``."""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def ensure_built(cache_dir: str | Path, name: str, build: Callable[[Path], object]) -> Path:
    """``cache_dir/name``, written by ``build(directory)`` on first use and reused after.

    The name identifies the model: a later call with another ``build`` gets the cached one. The
    build happens in a temporary sibling directory renamed into place, so a crash never leaves a
    half-written model and concurrent callers (several workers or servers starting) all see a
    complete one.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / name
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir))
    try:
        build(staging)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another builder: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
