"""Runtime adapter updates over a model's workers: each ready worker loads (or unloads) the adapter.

A model's workers serve the same adapters, so a load that fails on one worker is undone on those where
it succeeded, and the request gets the failure (the engine's refusal of a bad adapter: a 400 with its
message). The adapter becomes a name requests may use once every worker has it; an unload removes the
name first, so no new request picks it while the workers drop it (their running requests finish with
it: the engine's contract). Workers not ready now (loading, restarting) get the model's adapters from
their spec when they next start (``ModelPool.set_adapter``).
"""

import asyncio
import logging

from xinserve.server.errors import APIError
from xinserve.server.pool.model_pool import ModelPool
from xinserve.server.worker.messages import RequestError

logger = logging.getLogger("xinserve.server")


async def load_adapter(pool: ModelPool, name: str, path: str) -> None:
    """Load adapter ``name`` from ``path`` on every ready worker of ``pool``; an APIError when one fails."""
    workers = [w for w in pool.workers if w.ready]
    if not workers:
        raise APIError(503, f"No worker of model '{pool.name}' is ready (loading, failed or dead); see /health.",
                       code="model_unavailable")
    errors = await asyncio.gather(*(w.loras.load(name, path) for w in workers))
    failed = [e for e in errors if e is not None]
    if failed:
        loaded = [w for w, e in zip(workers, errors, strict=True) if e is None]
        await asyncio.gather(*(w.loras.unload(name) for w in loaded))
        # the request's own fault first: the same bad adapter fails on every worker
        error = min(failed, key=lambda e: not e.client_fault)
        raise _api_error(error, f"cannot load LoRA adapter '{name}'")
    pool.set_adapter(name, path)
    logger.info("%s: loaded LoRA adapter %s from %s on %d worker(s)", pool.name, name, path, len(workers))


async def unload_adapter(pool: ModelPool, name: str) -> None:
    """Unload adapter ``name`` from ``pool``: no new request may name it, each ready worker drops it."""
    pool.set_adapter(name, None)
    workers = [w for w in pool.workers if w.ready]
    for worker, error in zip(workers, await asyncio.gather(*(w.loras.unload(name) for w in workers)), strict=True):
        if error is not None:  # it no longer routes there; the worker's copy goes with its process
            logger.warning("%s/%s: unloading LoRA adapter %s failed: %s", pool.name, worker.label, name, error.message)
    logger.info("%s: unloaded LoRA adapter %s", pool.name, name)


def _api_error(error: RequestError, what: str) -> APIError:
    if error.client_fault:
        return APIError(400, f"{what}: {error.message}", param="lora_path")
    return APIError(error.status, f"{what}: {error.message}",
                    code="model_unavailable" if error.unavailable else None)
