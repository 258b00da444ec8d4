"""The embedded default model: ``path: embedded:<name>`` in a config means a tiny Llama built locally.

It is created on first use in ``$XINSERVE_CACHE_DIR`` (default ``~/.cache/xinserve``) by
``xinserve.server.embedded_model.llama_files.write_llama``; nothing is downloaded. The build runs in this
process: it writes the files directly from torch in well under a second, without the ~10 CPU seconds
of transformers' model classes that ``factory.make_tiny_model`` imports. ``llama_files`` imports torch
and transformers' configuration classes: only when a build is needed, one importer at a time
(``server/http/heavy_imports.py``).
"""

import logging
import time

from xinserve.kernels.cache_dir import cache_dir
from xinserve.server.embedded_model.build_once import ensure_built
from xinserve.server.embedded_model.hub import local_path
from xinserve.server.http.heavy_imports import IMPORT_LOCK
from xinserve.server.model_settings import EMBEDDED_PREFIX, ModelSettings

logger = logging.getLogger("xinserve.server")


def resolve_model_path(model: ModelSettings) -> str:
    """The model's directory on disk, building the embedded model first if needed (or fetching a
    hub id into the Hugging Face cache)."""
    if not model.is_embedded:
        return local_path(model.path)
    name = model.path[len(EMBEDDED_PREFIX):] or "xinserve-tiny"
    cache = cache_dir()
    # ensure_built renames a complete build into place, so an existing directory is complete.
    target = cache / name
    if target.is_dir():
        return str(target)
    # Several models of one config may resolve at once (each in a thread): one build at a time.
    with IMPORT_LOCK:
        from xinserve.server.embedded_model.llama_files import write_llama

        logger.info("building embedded model %r in %s (first use; nothing is downloaded)", name, cache)
        start = time.perf_counter()
        path = ensure_built(cache, name, write_llama)
    logger.info("embedded model %r ready in %.1fs", name, time.perf_counter() - start)
    return str(path)
