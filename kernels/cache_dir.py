"""Where xinserve keeps what it builds once per machine: the embedded model, kernel timings, inductor's cache."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$XINSERVE_CACHE_DIR``, else ``~/.cache/xinserve``."""
    return Path(os.environ.get("XINSERVE_CACHE_DIR") or Path.home() / ".cache" / "xinserve")
