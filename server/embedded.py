"""The embedded default model: ``path: embedded:<name>`` in a config means a tiny Llama built locally.

It is created on first use in ``$XINSERVE_CACHE_DIR`` (default ``~/.cache/xinserve``) by
``server.embedded_model.factory.ensure_tiny_model``; nothing is downloaded. The build runs in a spawned
child so torch and the model classes never load into the HTTP process.
"""

import logging
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor

from kernels.cache_dir import cache_dir
from server.hub import local_path
from server.model_settings import EMBEDDED_PREFIX, ModelSettings

logger = logging.getLogger("xinserve.server")


def _build(cache: str, name: str) -> str:
    from server.embedded_model.factory import ensure_tiny_model

    return str(ensure_tiny_model(cache, name))


def resolve_model_path(model: ModelSettings) -> str:
    """The model's directory on disk, building the embedded model first if needed (or fetching a
    hub id into the Hugging Face cache)."""
    if not model.is_embedded:
        return local_path(model.path)
    name = model.path[len(EMBEDDED_PREFIX):] or "xinserve-tiny"
    cache = cache_dir()
    # ensure_tiny_model renames a complete build into place, so an existing directory is complete.
    target = cache / name
    if target.is_dir():
        return str(target)
    logger.info("building embedded model %r in %s (first use; nothing is downloaded)", name, cache)
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        path = pool.submit(_build, str(cache), name).result()
    logger.info("embedded model %r ready in %.1fs", name, time.perf_counter() - start)
    return path
